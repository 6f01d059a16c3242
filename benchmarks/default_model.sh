#!/usr/bin/env bash
# The recipe of the built-in default model (docs/RESULTS.md): tokenizer, training, evaluation, packaging.
# Usage: benchmarks/default_model.sh WORKDIR [DATA_ROOT]   (DATA_ROOT holds corpus/, heldout/, evals/)
# Two otherwise idle CPU cores: about 80 minutes for training (bf16 autocast), ten minutes for the evaluations.
set -euo pipefail
work=${1:?usage: default_model.sh WORKDIR [DATA_ROOT]}
data=${2:-../shared/data}
sh=${SWITCHHEAD:-switchhead}
py=${PYTHON:-python}
mkdir -p "$work"

# 1-2. Tokenizer (8000-piece BPE, digits split, trained on the books) and training: 5000 steps x 16 lanes x
# 128 tokens, warm-up then cosine, validated on WikiText-103 valid. The books are hard-wrapped, so lines are
# joined into paragraphs first (--unwrap): otherwise the model learns to expect a line break every ~70 characters.
$sh train --config switchhead-small --data "$data/corpus" --unwrap --vocab-size 8000 \
  --eval-data "$data/heldout/wikitext103_valid.tokens.txt" --out "$work/run" --steps 5000 --batch-size 16 \
  --lr 1.2e-3 --warmup 200 --eval-every 2000 --eval-batch-size 64 --save-every 500 --dtype bfloat16 --device cpu

# 3. Zero-shot evaluation (CBT: the shared files are one-example format samples only).
$sh eval --tasks lambada,blimp,cbt --ckpt "$work/run/final" --data-dir "$data/evals" --output "$work/eval.json"

# 4. Package: half-precision weights as the package's built-in model.
$py -c "import sys, switchhead; m, t = switchhead.load(sys.argv[1]); switchhead.save(sys.argv[2], m.half(), t)" \
  "$work/run/final" switchhead/assets/default
