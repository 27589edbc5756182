#!/usr/bin/env python3
"""PyTorch's versions of two candle-amp examples on the same sizes, side by side with them.

Runs `quantized_sine --size 128 --hidden 256 --epochs 30` and `amp_recipe` (defaults: width
1024, batch 256, 50 batches x 3 epochs) in f32 and under CPU autocast (bf16), in PyTorch and in
candle-amp (release builds of the examples, `--json`), and prints ms per step for each and the
ratios. Needs a Python with torch (`pip install torch` in a throwaway venv); without one it says
so and exits 0. Not part of the test suite: a measurement, run by hand:

    python3 benches/peer/pytorch_peer.py            # from the repository root
    python3 benches/peer/pytorch_peer.py --json     # one JSON line
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time


def quantized_sine_torch(torch, size, hidden, epochs, amp):
    """ms per step of the quantized-sine 1x1-conv net, one step per epoch on the whole grid."""
    nn = torch.nn
    torch.manual_seed(0)
    coords = torch.linspace(0.0, 1.0, size)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    x = torch.stack([xx, yy]).unsqueeze(0)
    v = torch.cos(2 * math.pi * 4 * xx) + torch.cos(2 * math.pi * 2 * yy)
    target = (((v + 2) / 4 * 4).floor().clamp(0, 3) / 3).reshape(1, 1, size, size)
    layers = []
    widths = [2, hidden, hidden, hidden]
    for i in range(3):
        layers += [nn.Conv2d(widths[i], widths[i + 1], 1), nn.BatchNorm2d(hidden), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Conv2d(hidden, 1, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), target)
        loss.backward()
        opt.step()
        return loss.item()

    return timed(step, epochs)


def amp_recipe_torch(torch, width, batch, batches, epochs, amp):
    """ms per step of PyTorch's AMP recipe MLP (3 x Linear(w, w), ReLU, MSE, SGD lr 1e-3)."""
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(batches)]
    it = iter(range(10**9))

    def step():
        x, y = data[next(it) % batches]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        return loss.item()

    return timed(step, batches * epochs)


def timed(step, steps):
    """Mean ms per step over `steps` steps after two untimed ones."""
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1e3 / steps


def candle_amp(example, extra):
    """The example's `--json` figures (release build, bf16 AMP)."""
    cmd = ["cargo", "run", "-q", "--release", "--example", example, "--", "--json", "--precision", "bf16"]
    out = subprocess.run(cmd + extra, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: no torch in this Python (pip install torch in a throwaway venv)")
        return 0
    torch.set_num_threads(os.cpu_count() or 1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.chdir(root)

    sine = dict(size=128, hidden=256, epochs=30)
    recipe = dict(width=1024, batch=256, batches=50, epochs=3)
    rows = {}
    ours = candle_amp(
        "quantized_sine", ["--size", "128", "--hidden", "256", "--epochs", "30", "--out", "target/peer"]
    )
    rows["quantized_sine"] = {
        "torch_f32": quantized_sine_torch(torch, amp=False, **sine),
        "torch_bf16": quantized_sine_torch(torch, amp=True, **sine),
        "ours_f32": ours["f32"]["ms_per_step"],
        "ours_bf16": ours["amp"]["ms_per_step"],
    }
    ours = candle_amp("amp_recipe", [])
    rows["amp_recipe"] = {
        "torch_f32": amp_recipe_torch(torch, amp=False, **recipe),
        "torch_bf16": amp_recipe_torch(torch, amp=True, **recipe),
        "ours_f32": ours["f32"]["ms_per_step"],
        "ours_bf16": ours["amp"]["ms_per_step"],
    }
    for r in rows.values():
        r["ours_amp_vs_f32"] = r["ours_bf16"] / r["ours_f32"]
        r["torch_amp_vs_f32"] = r["torch_bf16"] / r["torch_f32"]
        r["ours_vs_torch_amp_step"] = r["ours_bf16"] / r["torch_bf16"]
        r["ours_vs_torch_f32_step"] = r["ours_f32"] / r["torch_f32"]
    if args.json:
        print(json.dumps({"torch": torch.__version__, **rows}))
        return 0
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads; ms per step (bf16 = CPU autocast)")
    print(f"{'workload':<16} {'torch f32':>10} {'torch bf16':>11} {'ours f32':>9} {'ours bf16':>10}"
          f" {'ours amp/f32':>13} {'torch amp/f32':>14} {'ours/torch amp':>15}")
    for name, r in rows.items():
        print(f"{name:<16} {r['torch_f32']:>10.1f} {r['torch_bf16']:>11.1f} {r['ours_f32']:>9.1f}"
              f" {r['ours_bf16']:>10.1f} {r['ours_amp_vs_f32']:>13.2f} {r['torch_amp_vs_f32']:>14.2f}"
              f" {r['ours_vs_torch_amp_step']:>15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
