#!/usr/bin/env bash
# An earlier commit's moeblaze, importable beside the current one as `moeblaze_base` (for tools/ab_compare.py):
#   bash tools/make_baseline.sh REV      -> .baseline/moeblaze_base (ignored by git; carry it to the GPU)
# Its custom ops are renamed to the moeblaze_base:: namespace so both packages can register theirs.
set -euo pipefail
rev=${1:?usage: make_baseline.sh REV}
rm -rf .baseline && mkdir -p .baseline/tmp
git archive "$rev" src/moeblaze | tar -x -C .baseline/tmp
mv .baseline/tmp/src/moeblaze .baseline/moeblaze_base && rm -rf .baseline/tmp
grep -rl 'moeblaze::' .baseline/moeblaze_base | xargs sed -i 's/moeblaze::/moeblaze_base::/g'
echo "$rev" > .baseline/REV
echo "baseline $(git rev-parse --short "$rev") in .baseline/moeblaze_base"
