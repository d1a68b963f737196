# test-count.awk - turns one ctest run into counted results for scripts/test.sh's closing line,
# so that nothing skipped is counted as passed. Input: ctest's console output (first file: the
# status of every test - Passed, ***Skipped for exit code 77, anything else a failure), then
# ctest's Testing/Temporary/LastTest.log (second file: every test's output, passing ones too).
# In a test's output it reads two things:
#   - "SKIP(<tag>): <what>" lines (tests/testutil.h: kvt_test_skip / kvt_test_skip_all in C,
#     tests/python/conftest.py for pytest, test_cli.py): each one is a skipped part, or the reason
#     of a whole-test skip;
#   - pytest's summary line ("12 passed, 2 skipped in 1.3s"): a pytest file counts as its test
#     functions, not as one test.
# Output, one record per line, tab-separated: kind (pass|fail|skip), count, tag (skips only),
# test name, what was skipped. POSIX awk only (Debian's default awk is mawk).
BEGIN { FS = "\n"; OFS = "\t"; n = 0 }

FNR == NR {
  if (match($0, /Test +#[0-9]+: [^ ]+ /)) {
    name = substr($0, RSTART, RLENGTH)
    sub(/^Test +#[0-9]+: /, "", name)
    sub(/ +$/, "", name)
    rest = substr($0, RSTART + RLENGTH)
    if (rest ~ /\*\*\*Skipped/ || rest ~ /Not Run \(Disabled\)/)
      st[name] = "skip"
    else if (rest ~ /Passed/)
      st[name] = "pass"
    else
      st[name] = "fail"
    if (!(name in seen)) { seen[name] = 1; names[++n] = name }
  }
  next
}

/^[0-9]+\/[0-9]+ Testing: / { cur = $0; sub(/^[0-9]+\/[0-9]+ Testing: /, "", cur); inout = 0; next }
cur != "" && $0 == "Output:" { inout = 1; getline; next }
inout && $0 == "<end of output>" { inout = 0; next }
inout && /^SKIP\([a-z0-9-]+\): / {
  i = index($0, ")")
  k = ++nskip[cur]
  sk_tag[cur, k] = substr($0, 6, i - 6)
  sk_what[cur, k] = substr($0, i + 3)
  next
}
inout && / in [0-9.]+s( \([0-9:]+\))?( =+)?$/ && /[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed)/ {
  line = $0
  sub(/^=+ /, "", line)
  sub(/ in [0-9.]+s.*$/, "", line)
  m = split(line, parts, ", ")
  py[cur] = 1
  pyp[cur] = pyf[cur] = pys[cur] = 0
  for (j = 1; j <= m; j++) {
    split(parts[j], w, " ")
    c = w[1] + 0
    if (w[2] == "passed" || w[2] == "xpassed") pyp[cur] += c
    else if (w[2] == "failed" || w[2] == "error" || w[2] == "errors") pyf[cur] += c
    else if (w[2] == "skipped" || w[2] == "xfailed") pys[cur] += c
  }
  next
}

END {
  for (i = 1; i <= n; i++) {
    t = names[i]
    s = st[t]
    ns = nskip[t] + 0
    if (t in py) {
      f = pyf[t]
      if (s == "fail" && f == 0) f = 1 # crashed or timed out after its summary
      if (pyp[t] > 0) print "pass", pyp[t], "", t, ""
      if (f > 0) print "fail", f, "", t, ""
      for (k = 1; k <= ns && k <= pys[t]; k++) print "skip", 1, sk_tag[t, k], t, sk_what[t, k]
      if (pys[t] > ns) print "skip", pys[t] - ns, "untagged", t, "pytest skips without a SKIP line"
      continue
    }
    if (s == "skip") {
      if (ns > 0) print "skip", 1, sk_tag[t, 1], t, sk_what[t, 1]
      else print "skip", 1, "untagged", t, "exit 77 without a SKIP line"
      continue
    }
    print s, 1, "", t, ""
    for (k = 1; k <= ns; k++) print "skip", 1, sk_tag[t, k], t, sk_what[t, k]
  }
}
