#!/usr/bin/env bash
# Run HERE (not on the device) before a GPU session: download the cp312 manylinux wheels that the
# lent machine's image lacks into .whl/ (git-ignored; carried with `carry=[".whl"]`), then check
# that they install, as the device README's command installs them, into a Python 3.12 target.
# The device has torch 2.11, numpy, PyYAML, pyarrow and fsspec; it lacks pydantic (and its
# pydantic-core / annotated-types / typing-inspection / typing-extensions>=4.16), omegaconf and
# zstandard.
# Versions are the ones CI tests with. Usage: bash bench/gpu/prepare.sh   (from the repo root)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
WHEELS=(
    pydantic==2.14.4
    pydantic_core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing_extensions==4.16.0
    omegaconf==2.4.0
    zstandard==0.23.0
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
PY=${PY:-python3}
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || grep -qxF '/.whl/' .gitignore \
    || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
size_kib=$(du -sk .whl | cut -f1)
if (( size_kib > 40 * 1024 )); then
    echo "prepare error: .whl/ is ${size_kib} KiB, over the 40 MiB budget" >&2
    exit 1
fi
# The device's install command, for a Python 3.12 target (pip resolves nothing: --no-deps).
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" --python-version 3.12 --implementation cp --only-binary=:all: \
    "${PLATFORMS[@]}" .whl/*.whl
for pkg in pydantic pydantic_core omegaconf annotated_types typing_inspection typing_extensions.py zstandard; do
    [[ -e "$target/$pkg" ]] || { echo "prepare error: $pkg missing after install" >&2; exit 1; }
done
echo "prepare: .whl/ holds $(ls .whl | wc -l) wheels, ${size_kib} KiB; they install into a py3.12 target"
echo "device command (one run, timeout_s 600, carry [\".whl\"]):"
echo '  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; python3 bench/gpu/check.py'
