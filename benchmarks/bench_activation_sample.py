"""The cost of one activation sample (the monitor's block-output hooks) on the default model.

    python benchmarks/bench_activation_sample.py [--steps 40] [--reps 3]

The default config's model (gpt_tiny) and micro-batch (16 x 256 tokens), 2 CPU threads, random
tokens: forward + backward + the statistics' sync, with the monitor's ActivationProbe installed for
the step and without, alternating in one process so the machine's drift hits both alike. Reported:
the median ms per step of each, their difference, and the direct measure, the wall time inside the
hooks (a mean and a variance of each block's output) per sample. With the samples a run takes
(monitor/cadence.py: at least 5 on a run of 5 checks or more), that is the share of the run's time
spent sampling.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from llmtrain.config.schema import Config, MonitorConfig
from llmtrain.model import GPT
from llmtrain.monitor.cadence import samples_expected
from llmtrain.monitor.probes import ActivationProbe


def step(model: GPT, x: torch.Tensor, y: torch.Tensor, probe: bool, inside: list[float]) -> float:
    """One forward/backward (with the probe when asked), its statistics read as the check reads
    them; seconds. `inside` collects the time spent in the hooks."""
    start = time.perf_counter()
    installed = ActivationProbe(model.blocks) if probe else None
    if installed is not None:  # time the hooks themselves: wrap each registered one
        for handle in installed.handles:
            module = next(m for m in model.blocks if handle.id in m._forward_hooks)
            hook = module._forward_hooks[handle.id]

            def timed(mod, inputs, output, hook=hook):  # noqa: ANN001, ANN202
                began = time.perf_counter()
                hook(mod, inputs, output)
                inside.append(time.perf_counter() - began)

            module._forward_hooks[handle.id] = timed
    logits = model(x)
    if installed is not None:
        installed.remove()
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    values = [loss.detach().reshape(1)]
    stats = installed.stats() if installed is not None else None
    if stats is not None:
        values += [torch.stack(stats[0]), torch.stack(stats[1])]
    torch.cat(values).tolist()  # the check's one sync
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps of each kind per repetition")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = Config()
    model = GPT(cfg.model, 256)
    x = torch.randint(0, 256, (16, cfg.model.block_size))
    y = torch.randint(0, 256, (16, cfg.model.block_size))
    for _ in range(5):  # warm-up
        step(model, x, y, True, [])
    times: dict[bool, list[float]] = {False: [], True: []}
    inside: list[float] = []
    for _ in range(args.reps):
        for _ in range(args.steps):
            for probe in (False, True):
                times[probe].append(step(model, x, y, probe, inside))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    per_sample = sum(inside) / (args.reps * args.steps)
    print(f"gpt_tiny, 16 x {cfg.model.block_size} tokens, 2 threads: median step {off * 1e3:.1f} ms without the "
          f"probe, {on * 1e3:.1f} ms with it ({(on / off - 1) * 100:+.1f}%, within the machine's noise)")
    print(f"inside the hooks: {per_sample * 1e3:.3f} ms per sample = {per_sample / off:.2%} of one step")
    monitor = MonitorConfig()
    for total_steps in (50, 100, 1000):
        samples = samples_expected(monitor, total_steps)
        print(f"a {total_steps}-step run: {samples} samples = {samples * per_sample / (total_steps * off):.3%} of its "
              "step time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
