"""A conv net fed by 2 workers with large float batches, pin_memory=False (NCHW convs)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    def __init__(self, n=4096):
        self.x = torch.randn(256, 3, 96, 96)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.x[i % 256], i % 10


if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Images(), batch_size=256, num_workers=2, pin_memory=False,
                        persistent_workers=True)
    for epoch in range(3):
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.cuda.synchronize()
