#!/usr/bin/env bash
# gpu_check_cli_test.sh — launch/gpu-check's command line without building or running anything:
# --help prints the usage and exits 0; a flag without its value and an unknown flag are errors
# (exit 2) whose one line names the flag; `plan` shows each command's items fitting the default
# budget, and reports a budget they do not fit. Prints PASS: / FAIL: lines.
set -uo pipefail
GC="$1"
fail() { echo "FAIL: $*"; exit 1; }
out="$("$GC" --help)" || fail "--help exited $?"
grep -q '^usage: launch/gpu-check COMMAND' <<<"$out" || fail "--help printed no usage"
for w in fetch core sanitize extended plan --out --budget build-gpu-deps; do
  grep -q -- "$w" <<<"$out" || fail "--help does not mention $w"
done
err="$("$GC" core --out 2>&1 >/dev/null)"; rc=$?
[ "$rc" -eq 2 ] || fail "'core --out' exited $rc"
[ "$(wc -l <<<"$err")" -eq 1 ] && grep -q -- '--out' <<<"$err" || fail "'core --out' said: $err"
err="$("$GC" core --frobnicate 2>&1 >/dev/null)"; rc=$?
[ "$rc" -eq 2 ] && grep -q -- '--frobnicate' <<<"$err" || fail "unknown flag: exit $rc: $err"
err="$("$GC" core 2>&1 >/dev/null)"; rc=$?
[ "$rc" -eq 2 ] && grep -q -- '--out' <<<"$err" || fail "core without --out: exit $rc: $err"
plan="$("$GC" plan)" || fail "plan exited $? at the default budget"
[ "$(grep -c ': fits$' <<<"$plan")" -eq 3 ] || fail "not every command fits: $plan"
"$GC" plan --budget 300 >/dev/null && fail "plan accepted a budget the items do not fit"
echo "PASS: gpu-check command line"
