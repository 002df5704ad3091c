"""nmk_sample under compute-sanitizer (tools/gpu_run.sh SANITIZE=1): draws of 1 and 8 rows at a
vocab that the kernel splits into slices (their CTAs meet at barriers in global scratch), each
twice, so the second launch finds the scratch the first one cleared, against the CPU twin:

    NORTHMK_LIB=BUILD/libnorthmk.so compute-sanitizer --tool racecheck python tools/sample_check.py

Exits 1 when a token differs from reference_draw's."""
import sys

import torch

from northmk.engine.gpu_sampling import DrawParams, GpuSampler, reference_draw

PARAMS = [
    DrawParams(0.0, 0, 1.0, 0.0, 1, 0),       # greedy
    DrawParams(1.0, 0, 1.0, 0.0, 2, 5),       # temperature
    DrawParams(0.7, 50, 1.0, 0.0, 3, 17),     # top_k
    DrawParams(1.1, 0, 0.9, 0.0, 4, 2),       # top_p
    DrawParams(0.9, 0, 1.0, 0.05, 5, 9),      # min_p
    DrawParams(0.8, 40, 0.95, 0.02, 6, 123),  # all together
    DrawParams(1.5, 3, 0.5, 0.0, 7, 1),
    DrawParams(0.3, 1, 0.01, 1.0, 8, 0),      # keeps only the top value
]


def main() -> int:
    if not torch.cuda.is_available():
        print("tools/sample_check.py: error: nmk_sample needs a CUDA device (torch sees none)", file=sys.stderr)
        return 2
    sampler, gen = GpuSampler("cuda"), torch.Generator("cuda").manual_seed(0)
    bad = 0
    for rows in (1, 8):
        logits = torch.randn(rows, 65536, device="cuda", generator=gen) * 2
        params = [PARAMS[(b + rows) % len(PARAMS)] for b in range(rows)]
        want, _ = reference_draw(logits, params)
        for attempt in range(2):
            got, _ = sampler.draw(logits, params)
            differ = [(b, int(g), int(w)) for b, (g, w) in enumerate(zip(got.cpu().long(), want)) if g != w]
            print(f"rows {rows}, draw {attempt}: " + (f"(row, kernel, twin) differ: {differ}" if differ else "as the twin"))
            bad += len(differ)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
