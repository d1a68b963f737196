#!/usr/bin/env bash
# Regenerates the committed seed corpus (fuzz/corpus/<target>/) from real kvtier output with
# fuzz_gen_corpus, built in build/ (configure it first). Review and commit the result.
# Seeds named *_format1 (entries and manifests in kvtier's entry format 1, which this build
# no longer writes but still reads) are kept as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build --target fuzz_gen_corpus -j 2
keep=$(mktemp -d)
trap 'rm -rf "$keep"' EXIT
find fuzz/corpus -name '*_format1' -exec cp --parents {} "$keep" \; 2>/dev/null || true
rm -rf fuzz/corpus
build/fuzz/fuzz_gen_corpus fuzz/corpus
if [ -d "$keep/fuzz/corpus" ]; then cp -r "$keep/fuzz/corpus/." fuzz/corpus/; fi
