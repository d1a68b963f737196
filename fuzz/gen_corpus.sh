#!/usr/bin/env bash
# Regenerates the committed seed corpus (fuzz/corpus/<target>/) from real kvtier output with
# fuzz_gen_corpus, built in build/ (configure it first). Review and commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build --target fuzz_gen_corpus -j 2
rm -rf fuzz/corpus
build/fuzz/fuzz_gen_corpus fuzz/corpus
