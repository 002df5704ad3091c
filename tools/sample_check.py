"""nmk_sample under compute-sanitizer (tools/gpu_run.sh SANITIZE=1): draws of 1 and 8 rows at a
vocab that the kernel splits into slices (their CTAs meet at barriers in global scratch), each
twice, so the second launch finds the scratch the first one cleared, against the CPU twin:

    NORTHMK_LIB=BUILD/libnorthmk.so compute-sanitizer --tool racecheck python tools/sample_check.py

Exits 1 when a token differs from reference_draw's."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the GPU tests' module, from a checkout

from northmk.engine.gpu_sampling import GpuSampler, reference_draw  # noqa: E402
from tests.gpu.test_sampling import MIXED, logits_of  # noqa: E402 (the GPU tests' rows and logits)


def main() -> int:
    if not torch.cuda.is_available():
        print("tools/sample_check.py: error: nmk_sample needs a CUDA device (torch sees none)", file=sys.stderr)
        return 2
    sampler, bad = GpuSampler("cuda"), 0
    for rows in (1, 8):
        logits = logits_of("peaked", rows, 65536, seed=rows)
        params = [MIXED[(b + rows) % len(MIXED)] for b in range(rows)]
        want, _ = reference_draw(logits, params)
        for attempt in range(2):
            got, _ = sampler.draw(logits, params)
            differ = [(b, int(g), int(w)) for b, (g, w) in enumerate(zip(got.cpu().long(), want)) if g != w]
            print(f"rows {rows}, draw {attempt}: " + (f"(row, kernel, twin) differ: {differ}" if differ else "as the twin"))
            bad += len(differ)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
