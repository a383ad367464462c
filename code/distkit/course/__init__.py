"""distkit.course: the course's own tooling, which lesson scripts never import.

Used by the notebooks:
- `notebook`: launch a lesson script from a cell (failing the cell when the launch fails, with
  the script's last lines in the error), diffs and source excerpts of scripts, and the checks
  and reports that the notebooks' compared cells make of their runs' results.
- `plots`: the measured pictures the notebooks draw from their runs' JSON.

Behind the `make` targets:
- `run_course`: `make course`, every notebook through papermill.
- `check`: `make check`, a pre-flight for a participant's machine.
- `exercise` and `checks/` (one module per chapter): `make exercise EX=NN.k` checks a learner's
  file; starters are generated from the solutions.
- `site` and `site_template/`: `make site`, the course as a static website.
- `gpu_smoke`: `make gpu-smoke`, every chapter's GPU path where GPUs exist.
- `diagrams/`: `make images`, the explanatory pictures in images/ (one module per chapter).
- `torchrun`: torchrun as `code/run_w_torchrun.sh` runs it, with a short failure report.
- `record`: `make record NB=NN`, a notebook's stored outputs (refused on a busy machine).
- `chapters`: each chapter's metadata from its notebook's first cell (the README's path table,
  the website, tests/test_chapters.py); `--write` fills in the reading times.
- `torch_wheels`: `make setup`, which build of torch to install (the CPU wheels without a GPU).
- `portable`: the rule every compared output keeps to hold on any CPU (no float noise),
  checked on the stored notebooks by tests/test_portability.py.
- `launch_cost`: where `make course`'s CPU goes, each notebook's launches split into their
  floor (torchrun's agent, each rank's imports) and the lesson's work (docs/timings.md).
"""
