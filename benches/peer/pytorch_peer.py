#!/usr/bin/env python3
"""PyTorch's versions of three candle-amp examples on the same sizes, side by side with them.

On CPU (the default) it runs `quantized_sine --size 128 --hidden 256 --epochs 30`,
`amp_recipe` (defaults: width 1024, batch 256, 50 batches x 3 epochs) and `gpt --width 256
--seq 64 --batch 16 --steps 30` (2 layers, 4 heads; both sides' attention the fused op,
PyTorch's also timed written out) in f32 and under CPU autocast (bf16). With `--device cuda` it runs larger sizes (`quantized_sine --size 512`, and
PyTorch's AMP recipe itself: width 4096, batch 512) in f32 and under CUDA autocast (fp16 with a
GradScaler, as `torch.autocast("cuda")` and candle-amp's examples do on CUDA). Each runs in
PyTorch and in candle-amp (release builds of the examples, `--json`), and it prints ms per step
for each and the ratios. Needs a Python with torch (`pip install torch` in a throwaway venv);
without one it says so and exits 0. Not part of the test suite: a measurement, run by hand:

    python3 benches/peer/pytorch_peer.py            # from the repository root
    python3 benches/peer/pytorch_peer.py --json     # one JSON line
    python3 benches/peer/pytorch_peer.py --device cuda --examples DIR   # prebuilt examples in DIR
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time


def quantized_sine_torch(torch, dev, size, hidden, epochs, amp):
    """ms per step of the quantized-sine 1x1-conv net, one step per epoch on the whole grid."""
    nn = torch.nn
    torch.manual_seed(0)
    coords = torch.linspace(0.0, 1.0, size, device=dev.name)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    x = torch.stack([xx, yy]).unsqueeze(0)
    v = torch.cos(2 * math.pi * 4 * xx) + torch.cos(2 * math.pi * 2 * yy)
    target = (((v + 2) / 4 * 4).floor().clamp(0, 3) / 3).reshape(1, 1, size, size)
    layers = []
    widths = [2, hidden, hidden, hidden]
    for i in range(3):
        layers += [nn.Conv2d(widths[i], widths[i + 1], 1), nn.BatchNorm2d(hidden), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Conv2d(hidden, 1, 1)).to(dev.name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return timed(dev.step(torch, model, opt, amp, lambda: (x, target)), epochs)


def amp_recipe_torch(torch, dev, width, batch, batches, epochs, amp):
    """ms per step of PyTorch's AMP recipe MLP (3 x Linear(w, w), ReLU, MSE, SGD lr 1e-3)."""
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)
    ).to(dev.name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [
        (torch.randn(batch, width, device=dev.name), torch.randn(batch, width, device=dev.name))
        for _ in range(batches)
    ]
    it = iter(range(10**9))
    return timed(dev.step(torch, model, opt, amp, lambda: data[next(it) % batches]), batches * epochs)


def gpt_torch(torch, dev, width, seq, batch, layers, heads, vocab, steps, amp, attention="sdpa"):
    """ms per step of the GPT-2-style decoder of `examples/gpt.rs`: tied embeddings, pre-norm
    blocks, causal attention as `F.scaled_dot_product_attention(is_causal=True)` (as its model
    calls `ops::scaled_dot_product_attention`), or with `attention="eager"` written out (scores,
    additive causal mask, softmax) as Hugging Face's eager GPT-2 attention does, tanh GELU,
    cross-entropy, AdamW (lr 3e-4, no decay). Random token ids: the timing does not depend on
    them."""
    nn = torch.nn
    F = nn.functional
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x, mask):
            b, t, c = x.shape
            split = lambda z: z.view(b, t, heads, c // heads).transpose(1, 2)
            q, k, v = (split(z) for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
            if attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // heads)) + mask
                y = F.softmax(att, dim=-1) @ v
            x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, width)
            self.wpe = nn.Embedding(max(seq, 32) + 32, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)

        def forward(self, ids, mask):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x, mask)
            return self.ln_f(x) @ self.wte.weight.t()

    model = Gpt().to(dev.name)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    ids = torch.randint(vocab, (batch, seq + 1), device=dev.name)
    mask = torch.full((seq, seq), float("-inf"), device=dev.name).triu(1)
    dtype = torch.float16 if dev.cuda else torch.bfloat16
    scaler = torch.amp.GradScaler(dev.name, enabled=amp and dev.cuda)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.name, dtype=dtype, enabled=amp):
            logits = model(ids[:, :-1], mask)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.item()

    return timed(step, steps)


def resnet_torch(torch, dev, depth, image_size, classes, batch, steps, amp):
    """ms per step of `examples/resnet.rs`'s model: torchvision's ResNet (bottleneck blocks for
    50, stride on the 3x3 conv), built here so torchvision is not needed; batch norm in training
    mode, cross-entropy on f32 logits, plain SGD (lr 0.02). Random images: the timing does not
    depend on them."""
    nn = torch.nn
    torch.manual_seed(0)

    def conv_bn(c_in, c_out, k, stride, relu):
        layers = [nn.Conv2d(c_in, c_out, k, stride, k // 2, bias=False), nn.BatchNorm2d(c_out)]
        return nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)

    class Block(nn.Module):
        def __init__(self, c_in, planes, stride):
            super().__init__()
            if depth == 50:
                shapes, c_out = [(c_in, planes, 1, 1), (planes, planes, 3, stride), (planes, 4 * planes, 1, 1)], 4 * planes
            else:
                shapes, c_out = [(c_in, planes, 3, stride), (planes, planes, 3, 1)], planes
            self.body = nn.Sequential(*(conv_bn(*s, relu=i < len(shapes) - 1) for i, s in enumerate(shapes)))
            self.down = conv_bn(c_in, c_out, 1, stride, relu=False) if stride != 1 or c_in != c_out else None
            self.c_out = c_out

        def forward(self, x):
            return torch.relu(self.body(x) + (self.down(x) if self.down is not None else x))

    blocks = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3]}[depth]
    layers, c_in = [conv_bn(3, 64, 7, 2, relu=True), nn.MaxPool2d(3, 2, 1)], 64
    for i, n in enumerate(blocks):
        for b in range(n):
            block = Block(c_in, 64 << i, 2 if b == 0 and i > 0 else 1)
            layers.append(block)
            c_in = block.c_out
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)).to(dev.name)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    x = torch.randn(batch, 3, image_size, image_size, device=dev.name)
    y = torch.randint(classes, (batch,), device=dev.name)
    dtype = torch.float16 if dev.cuda else torch.bfloat16
    scaler = torch.amp.GradScaler(dev.name, enabled=amp and dev.cuda)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.name, dtype=dtype, enabled=amp):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.item()

    return timed(step, steps)


class Device:
    """What differs between the CPU and the CUDA runs: autocast's dtype, the GradScaler, sizes."""

    def __init__(self, name):
        self.name = name
        self.cuda = name == "cuda"
        self.precision = "fp16" if self.cuda else "bf16"
        if self.cuda:
            self.sine = dict(size=512, hidden=256, epochs=50)
            self.recipe = dict(width=4096, batch=512, batches=50, epochs=3)
        else:
            self.sine = dict(size=128, hidden=256, epochs=30)
            self.recipe = dict(width=1024, batch=256, batches=50, epochs=3)
        self.gpt = dict(width=256, seq=64, batch=16, layers=2, heads=4, vocab=16, steps=30)
        # GPU only: ResNet-50 on batches of 64 and of 256 images of 128x128, 16 steps each (2
        # epochs of 8 batches in ours). At 64 both frameworks' steps are bound by the host's
        # launches (AMP's gain hidden); at 256 the GPU's work sets the pace, as in training.
        self.resnet = [dict(depth=50, image_size=128, classes=8, batch=b, steps=16)
                       for b in ((64, 256) if self.cuda else ())]

    def step(self, torch, model, opt, amp, batch):
        """One training step (MSE loss, read back as a float: a sync per step, as ours)."""
        nn = torch.nn
        dtype = torch.float16 if self.cuda else torch.bfloat16
        # fp16 needs loss scaling; bf16 does not (PyTorch's recipes)
        scaler = torch.amp.GradScaler(self.name, enabled=amp and self.cuda)

        def step():
            x, y = batch()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(self.name, dtype=dtype, enabled=amp):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.item()

        return step


def timed(step, steps):
    """Mean ms per step over `steps` steps after two untimed ones."""
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1e3 / steps


def candle_amp(examples, dev, example, extra):
    """The example's `--json` figures (release build; from `examples` when given, else cargo)."""
    if examples:
        cmd = [os.path.join(examples, example)]
    else:
        cmd = ["cargo", "run", "-q", "--release", "--example", example, "--"]
    cmd += ["--json", "--precision", dev.precision, "--device", dev.name]
    return run_json(cmd + extra)


class WorkloadFailed(Exception):
    """One of our examples exited with an error: its row is reported as failed, the others run."""


def run_json(cmd):
    """The last stdout line of `cmd` as JSON, or WorkloadFailed with its stderr."""
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise WorkloadFailed(f"{' '.join(cmd)} could not start: {e}") from e
    if run.returncode != 0:
        raise WorkloadFailed(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def peak_ratio(ours, amp_key):
    """Our AMP mode's peak memory over our f32 mode's, where the example reports peaks."""
    try:
        return ours[amp_key]["peak_bytes"] / ours["f32"]["peak_bytes"]
    except (KeyError, ZeroDivisionError):
        return None


def ours_figures(ours, amp_key):
    """Our row's fields from an example's `--json`: the f32 and AMP steps, the peak ratio, and
    where the steps' host time goes when the example reports it (forward, backward, scaler and
    optimizer, loss read)."""
    figures = {
        "ours_f32": ours["f32"]["ms_per_step"],
        "ours_amp": ours[amp_key]["ms_per_step"],
        "ours_peak_amp_vs_f32": peak_ratio(ours, amp_key),
    }
    if "host_ms" in ours[amp_key]:
        figures["ours_host_ms"] = {"f32": ours["f32"]["host_ms"], "amp": ours[amp_key]["host_ms"]}
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--examples", help="folder of prebuilt release examples (default: cargo run)")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: no torch in this Python (pip install torch in a throwaway venv)")
        return 0
    torch.set_num_threads(os.cpu_count() or 1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.chdir(root)

    dev = Device(args.device)

    def sine():
        sine = dev.sine
        ours = candle_amp(
            args.examples, dev, "quantized_sine",
            ["--size", str(sine["size"]), "--hidden", str(sine["hidden"]), "--epochs", str(sine["epochs"]),
             "--out", "target/peer"],
        )
        return {
            "torch_f32": quantized_sine_torch(torch, dev, amp=False, **sine),
            "torch_amp": quantized_sine_torch(torch, dev, amp=True, **sine),
            **ours_figures(ours, "amp"),
        }

    def recipe():
        recipe = dev.recipe
        ours = candle_amp(
            args.examples, dev, "amp_recipe",
            ["--width", str(recipe["width"]), "--batch", str(recipe["batch"])],
        )
        return {
            "torch_f32": amp_recipe_torch(torch, dev, amp=False, **recipe),
            "torch_amp": amp_recipe_torch(torch, dev, amp=True, **recipe),
            **ours_figures(ours, "amp"),
        }

    def gpt():
        gpt = dev.gpt
        cmd = [os.path.join(args.examples, "gpt")] if args.examples else [
            "cargo", "run", "-q", "--release", "--example", "gpt", "--"]
        cmd += ["--json", "--device", dev.name, "--out", "target/peer", "--lr", "3e-4"] + [
            a for key in ("width", "seq", "batch", "steps") for a in (f"--{key}", str(gpt[key]))]
        ours = run_json(cmd)
        return {
            "torch_f32": gpt_torch(torch, dev, amp=False, **gpt),
            "torch_amp": gpt_torch(torch, dev, amp=True, **gpt),
            "torch_amp_eager_attention": gpt_torch(torch, dev, amp=True, attention="eager", **gpt),
            **ours_figures(ours, dev.precision),
        }

    def resnet(res):
        ours = candle_amp(
            args.examples, dev, "resnet",
            ["--depth", str(res["depth"]), "--image-size", str(res["image_size"]),
             "--classes", str(res["classes"]), "--batch", str(res["batch"]),
             "--train-per-class", str(res["batch"] * res["steps"] // 2 // res["classes"]),
             "--val-per-class", "8", "--epochs", "2", "--out", "target/peer"],
        )
        return {
            "torch_f32": resnet_torch(torch, dev, amp=False, **res),
            "torch_amp": resnet_torch(torch, dev, amp=True, **res),
            **ours_figures(ours, "amp"),
        }

    workloads = [("quantized_sine", sine), ("amp_recipe", recipe), ("gpt", gpt)] + [
        (f"resnet{res['depth']} b{res['batch']}", lambda res=res: resnet(res)) for res in dev.resnet]
    # A workload whose example fails is reported and skipped: the others' figures still come.
    rows, failed = {}, {}
    for name, workload in workloads:
        try:
            rows[name] = workload()
        except WorkloadFailed as e:
            failed[name] = str(e)
            print(f"{name}: {e}", file=sys.stderr)
    for r in rows.values():
        r["ours_amp_vs_f32"] = r["ours_amp"] / r["ours_f32"]
        r["torch_amp_vs_f32"] = r["torch_amp"] / r["torch_f32"]
        r["ours_vs_torch_amp_step"] = r["ours_amp"] / r["torch_amp"]
        r["ours_vs_torch_f32_step"] = r["ours_f32"] / r["torch_f32"]
    if args.json:
        print(json.dumps({"torch": torch.__version__, "device": dev.name, "precision": dev.precision,
                          **rows, "failed": sorted(failed)}))
        return 1 if failed else 0
    where = torch.cuda.get_device_name() if dev.cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"PyTorch {torch.__version__}, {where}; ms per step (amp = {dev.precision} autocast)")
    print(f"{'workload':<16} {'torch f32':>10} {'torch amp':>10} {'ours f32':>9} {'ours amp':>9}"
          f" {'ours amp/f32':>13} {'torch amp/f32':>14} {'ours/torch amp':>15} {'ours peak amp/f32':>18}")
    for name, r in rows.items():
        print(f"{name:<16} {r['torch_f32']:>10.2f} {r['torch_amp']:>10.2f} {r['ours_f32']:>9.2f}"
              f" {r['ours_amp']:>9.2f} {r['ours_amp_vs_f32']:>13.2f} {r['torch_amp_vs_f32']:>14.2f}"
              f" {r['ours_vs_torch_amp_step']:>15.2f}"
              f" {'-' if r['ours_peak_amp_vs_f32'] is None else format(r['ours_peak_amp_vs_f32'], '.2f'):>18}")
    if "gpt" in rows:
        eager = rows["gpt"]["torch_amp_eager_attention"]
        print(f"(gpt: both sides attend with the fused op; PyTorch's amp step with the attention"
              f" written out: {eager:.2f} ms)")

    # Where our step's host time goes: on a GPU, phases that add up to the step are launch-bound.
    for name, r in rows.items():
        for mode, host in r.get("ours_host_ms", {}).items():
            phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in host.items())
            print(f"({name}, ours {mode}: host ms per step: {phases})")
    for name in failed:
        print(f"{name}: FAILED (its error is above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
