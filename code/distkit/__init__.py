"""distkit: the course's plumbing, written once so the lesson scripts show only the lesson.

- `setup()` / `teardown()`: pick device and backend, start the process group with a short timeout.
- `pick_device()`: CUDA + NCCL when there is a GPU, else CPU + gloo (override: COURSE_DEVICE).
- `seed_everything()`: one seed for Python, NumPy and torch.
- `print0()` / `print_ranks()`: print from rank 0, or every rank's text in rank order.
- `write_json()`: rank 0 writes measured results for notebooks and tests to read.

Notebook-side helpers (launching scripts, showing diffs) live in `distkit.notebook`.
"""
from .dist import (DistEnv, pick_device, print0, print_ranks, seed_everything, setup,
                   teardown, write_json)

__all__ = ["DistEnv", "pick_device", "print0", "print_ranks", "seed_everything", "setup",
           "teardown", "write_json"]
