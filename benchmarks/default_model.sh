#!/usr/bin/env bash
# The recipe of the built-in default model (docs/RESULTS.md): tokenizer, training, evaluation, packaging.
# Usage: benchmarks/default_model.sh WORKDIR [DATA_ROOT]   (DATA_ROOT holds corpus/, heldout/, evals/)
# Two CPU cores: about two hours for training (bf16 autocast), half an hour for the evaluations.
set -euo pipefail
work=${1:?usage: default_model.sh WORKDIR [DATA_ROOT]}
data=${2:-../shared/data}
sh=${SWITCHHEAD:-switchhead}
py=${PYTHON:-python}
mkdir -p "$work"

# 1. Tokenizer: 8000-piece BPE, digits split, on the training books only.
$py -c "import glob, sys; from switchhead.model.tokenizer import train_tokenizer, save_tokenizer; \
save_tokenizer(train_tokenizer(sorted(glob.glob(sys.argv[1] + '/corpus/*.txt')), 8000), sys.argv[2])" \
  "$data" "$work/tokenizer.model"

# 2. Training: 2600 steps x 16 lanes x 128 tokens, warm-up then cosine, validated on WikiText-103 valid.
$sh train --config switchhead-small --data "$data/corpus" --tokenizer "$work/tokenizer.model" \
  --eval-data "$data/heldout/wikitext103_valid.tokens.txt" --out "$work/run" --steps 2600 --batch-size 16 \
  --lr 1.2e-3 --warmup 200 --eval-every 800 --eval-batch-size 64 --save-every 200 --dtype bfloat16 --device cpu

# 3. Zero-shot evaluation (CBT: the shared files are one-example format samples only).
$sh eval --tasks lambada,blimp,cbt --ckpt "$work/run/final" --data-dir "$data/evals" --output "$work/eval.json"

# 4. Package: half-precision weights as the package's built-in model.
$py -c "import sys, switchhead; m, t = switchhead.load(sys.argv[1]); switchhead.save(sys.argv[2], m.half(), t)" \
  "$work/run/final" switchhead/assets/default
