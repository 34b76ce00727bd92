"""How often a top_k row takes the lane band (on since session 14) at vocabulary 65,536 and the kernel's block of
1,024 lanes: the share of Gaussian rows with at least k values above b3 (the largest of the lanes' third values)
and at most CAP = 1,024 of them. python .gpu/lane_band_rate.py [ROWS]; CPU, a few seconds."""
import sys

import torch

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
gen = torch.Generator().manual_seed(0)
print("| logits | k | rows taking the lane band | values above b3, min / median |")
print("|---|---|---|---|")
for sigma in (1.0, 6.0):
    x = torch.randn(rows, 65536, generator=gen) * sigma
    b3 = x.view(rows, 64, 1024).topk(3, dim=1).values[:, 2, :].max(1).values  # id = chunk · 1,024 + lane
    nb = (x > b3[:, None]).sum(1)
    for k in (20, 50, 100, 200):
        share = ((nb >= k) & (nb <= 1024)).float().mean().item()
        print(f"| σ={sigma:g} | {k} | {share:.1%} | {nb.min().item()} / {nb.median().item()} |")
