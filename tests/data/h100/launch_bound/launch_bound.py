"""Many tiny layers, small batch, on the GPU: the host launches kernels slower than they run."""
import torch
from torch import nn

torch.manual_seed(0)
layers = []
for _ in range(24):
    layers += [nn.Linear(64, 64), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(64, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(32, 64, device="cuda")
y = torch.randint(0, 10, (32,), device="cuda")
for step in range(400):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 50 == 0:
        print(step, loss.item())
