
import sys, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CYCLES = 2_000_000  # ~1 ms of device time at ~2 GHz


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(2 * CYCLES)
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 10)

    def forward(self, x):
        torch.cuda._sleep(CYCLES)
        return SleepInBackward.apply(self.lin(x))


epochs, sync = int(sys.argv[1]), sys.argv[2] == "sync"
dev = "cuda"
ds = TensorDataset(torch.randn(1024, 256), torch.randint(0, 10, (1024,)))
loader = DataLoader(ds, batch_size=64, shuffle=True, pin_memory=True, drop_last=True)
model = Net().to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if not sync:
    torch.cuda.set_sync_debug_mode("error")
for epoch in range(epochs):
    for x, y in loader:
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sync:
            loss.item()
torch.cuda.set_sync_debug_mode("default")
torch.cuda.synchronize()
