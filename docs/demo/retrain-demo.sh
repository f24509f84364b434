#!/usr/bin/env bash
# The retraining loop end to end on the embedded target; its output and figures: docs/retraining-demo.md.
#   1. distill the code domain: the first champion
#   2. retrain on a batch of new code traffic: the gate decides, with its figures
#   3. chat traffic: `monitor` fires first (exit 1), then a retrain on it
#   4. roll back
# Budgets are smaller than recipes/code.yaml's (800 prompts, 450 steps) so the whole loop fits in about an hour
# on a 2-core CPU. Rerunning it resumes: every stage and the registry are idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-runs/demo}
DS=${DS:-.venv/bin/draftsmith}
PY=${PY:-.venv/bin/python}
SMALL=(runs_dir="$RUNS" data.max_prompts=800 train.steps=450 train.save_every=150)
step() { echo; echo "== $*"; }

step "1. distill the code domain (the champion)"
$DS distill --domain code --run-id demo-champion "${SMALL[@]}"
$DS drafts list --domain code --runs-dir "$RUNS"

step "2. retrain on new code traffic"
[ -f "$RUNS/traffic/code.jsonl" ] || $PY docs/demo/make_traffic.py code --run "$RUNS/code/demo-champion" --n 200 \
  --out "$RUNS/traffic/code.jsonl"
$DS monitor --domain code --traffic "$RUNS/traffic/code.jsonl" "${SMALL[@]}" || echo "monitor exit $?"
$DS retrain --domain code --traffic "$RUNS/traffic/code.jsonl" "${SMALL[@]}" retrain.steps=150

step "3. chat traffic: monitor first, retrain when it fires"
[ -f "$RUNS/traffic/chat.jsonl" ] || $PY docs/demo/make_traffic.py chat --n 160 --out "$RUNS/traffic/chat.jsonl"
rc=0; $DS monitor --domain code --traffic "$RUNS/traffic/chat.jsonl" "${SMALL[@]}" || rc=$?
echo "monitor exit $rc"
if [ "$rc" = 1 ]; then
  $DS retrain --domain code --traffic "$RUNS/traffic/chat.jsonl" "${SMALL[@]}" retrain.steps=150
fi
$DS drafts list --domain code --runs-dir "$RUNS"

step "4. roll back"
$DS drafts rollback --domain code --runs-dir "$RUNS"
$DS drafts list --domain code --runs-dir "$RUNS"
$DS report --domain code --runs-dir "$RUNS" --out "$RUNS/report.html"
