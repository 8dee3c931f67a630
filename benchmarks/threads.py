"""Which CPU ops give other bits by torch's thread count, what a setting that makes them agree costs (issue 29).

Three measurements with the tiny Flux VAE's encoder (benchmarks/_common.py's model set), fp32, a batch of
``--batch`` images of ``--size`` px:

1. Each leaf module of the encoder, run at 1 thread with its inputs recorded, then replayed at 2 threads on the
   same inputs: the modules whose output changes (the ops that sum by thread).
2. The whole encoder at 1 and 2 threads under each setting: the default (oneDNN convolutions),
   ``torch.backends.mkldnn.deterministic``, oneDNN off; whether 1 and 2 threads agree, each side's best time
   as a ratio to the default at 2 threads, interleaved rounds.
3. Two processes at once (two ranks on the machine), each at 1 thread and each at 2 threads: the cost of
   giving every rank the plan's count on shared cores (wall time of both, interleaved, best of rounds).

What diffprep does with it: diffprep/run/threads.py (the plan fixes the count).
"""

from __future__ import annotations

import _env  # noqa: F401  (first: offline environment, --malloc re-exec before torch is imported)

# isort: split

import argparse
import subprocess
import sys
import time

import torch
from diffusers import AutoencoderKL

import _common as c

SETTINGS = ("default", "mkldnn-deterministic", "no-mkldnn")

RANK = r"""
import sys, torch
from diffusers import AutoencoderKL
torch.set_num_threads(int(sys.argv[2]))
vae = AutoencoderKL.from_pretrained(sys.argv[1]).eval()
x = torch.rand(int(sys.argv[3]), 3, int(sys.argv[4]), int(sys.argv[4])) * 2 - 1
with torch.no_grad():
    vae.encoder(x)
    sys.stdout.write("ready\n"); sys.stdout.flush(); sys.stdin.readline()
    for _ in range(int(sys.argv[5])):
        vae.encoder(x)
"""


def use(setting: str) -> None:
    torch.backends.mkldnn.enabled = setting != "no-mkldnn"
    torch.backends.mkldnn.deterministic = setting == "mkldnn-deterministic"


def varying_modules(vae: AutoencoderKL, x: torch.Tensor) -> list[str]:
    records = []
    leaves = [m for m in vae.encoder.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(lambda m, i, o: records.append((m, [t.clone() for t in i], o.clone())))
             for m in leaves]
    torch.set_num_threads(1)
    vae.encoder(x)
    for hook in hooks:
        hook.remove()
    torch.set_num_threads(2)
    found: dict[str, float] = {}
    for module, inputs, output in records:
        again = module(*inputs)
        if not torch.equal(again, output):
            name = f"{type(module).__name__} {tuple(inputs[0].shape)}"
            found[name] = max(found.get(name, 0.0), (again - output).abs().max().item())
    return [f"{name}: max |d| {d:.1e}" for name, d in found.items()]


def two_processes(folder: str, threads: int, args: argparse.Namespace) -> float:
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, folder, str(threads), str(args.batch), str(args.size),
                               str(args.repeats)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    for rank in ranks:
        rank.stdout.readline()
    start = time.perf_counter()
    for rank in ranks:
        rank.stdin.write("go\n")
        rank.stdin.flush()
    for rank in ranks:
        rank.wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_common_flags(parser)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=6, help="encoder calls per process in measurement 3")
    args = parser.parse_args()
    print(c.describe_machine(), f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    folder = str(c.tiny_model(c.cache_dir(args.cache_dir)) / "vae")
    vae = AutoencoderKL.from_pretrained(folder).eval()
    torch.manual_seed(0)
    x = torch.rand(args.batch, 3, args.size, args.size) * 2 - 1
    with torch.no_grad():
        print("1. modules whose output differs at 1 and 2 threads (same inputs):")
        for line in varying_modules(vae, x) or ["none"]:
            print(f"    {line}")
        times = {(s, t): [] for s in SETTINGS for t in (1, 2)}
        outputs = {}
        order = list(times)
        for r in range(args.rounds):
            for setting, threads in (order if r % 2 == 0 else order[::-1]):
                use(setting)
                torch.set_num_threads(threads)
                start = time.perf_counter()
                outputs[setting, threads] = vae.encoder(x)
                times[setting, threads].append(time.perf_counter() - start)
        use("default")
        base = c.best(times["default", 2])
        print("2. the whole encoder, time as a ratio to the default at 2 threads (best of rounds):")
        for setting in SETTINGS:
            agree = torch.equal(outputs[setting, 1], outputs[setting, 2])
            same = torch.equal(outputs[setting, 2], outputs["default", 2])
            print(f"    {setting:22s} 1 and 2 threads agree: {agree!s:5s} default's bytes: {same!s:5s} "
                  f"1 thread {c.best(times[setting, 1]) / base:.2f}x, 2 threads {c.best(times[setting, 2]) / base:.2f}x")
    walls = {1: [], 2: []}
    for r in range(max(2, args.rounds // 2)):
        for threads in ((1, 2) if r % 2 == 0 else (2, 1)):
            walls[threads].append(two_processes(folder, threads, args))
    print(f"3. two processes at once: 2 threads each / 1 thread each = {c.best(walls[2]) / c.best(walls[1]):.2f} "
          f"(best {c.best(walls[2]):.2f} s against {c.best(walls[1]):.2f} s)")


if __name__ == "__main__":
    main()
