#!/usr/bin/env bash
# Install the optional extras one after another into a fresh venv and import each after its
# install, together with everything installed before it: catches an extra whose dependencies
# break another's (e.g. `[eval]` after `[hf]` upgrading huggingface-hub past transformers' range)
# and pins that no longer resolve at once (pip's backtracking notice fails the run).
#
#   bash scripts/check_extras.sh [VENV_DIR]      (default: a temp dir, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-$(mktemp -d)/venv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv "$VENV"
pip_install() {  # the full log (pip's backtracking notices are INFO lines) goes to pip.log
    "$VENV/bin/pip" install "$@" >>"$VENV/pip.log" 2>&1 || { tail -30 "$VENV/pip.log"; exit 1; }
}
pip_install -e .

declare -A MODULES=(
    [hf]="transformers safetensors.torch tokenizers huggingface_hub"
    [eval]="lm_eval lm_eval.api.model lm_eval.tasks datasets tqdm bytelatent.eval.harness"
    [wandb]="wandb"
    [plot]="matplotlib.pyplot apps.plot"
)
imported=""
for extra in hf eval wandb plot; do
    start=$SECONDS
    pip_install -e ".[$extra]"
    imported="$imported ${MODULES[$extra]}"
    MPLBACKEND=Agg "$VENV/bin/python" -c "
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from transformers import BltForCausalLM
" $imported
    echo "check_extras: [$extra] installed in $((SECONDS - start)) s; imports ok:$imported"
done
"$VENV/bin/pip" check
if grep -q "looking at multiple versions\|does not provide the extra" "$VENV/pip.log"; then
    echo "check_extras: pip backtracked (see $VENV/pip.log); pin the versions in setup.py" >&2
    exit 1
fi
echo "check_extras: [hf] [eval] [wandb] [plot] install one after another and import together"
