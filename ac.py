import sys, torch, torch.nn as nn
W = int(sys.argv[1]); B = int(sys.argv[2]); AC = sys.argv[3] == "ac"
model = nn.Sequential(nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
x = torch.randn(B, W); y = torch.randint(0, 10, (B,))
for step in range(int(sys.argv[4]) if len(sys.argv) > 4 else 80):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AC):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
