#!/usr/bin/env bash
# gpu_check_cli_test.sh — launch/gpu-check's command line without building or running anything:
# --help prints the usage and exits 0; a flag without its value and an unknown flag are errors
# (exit 2) whose one line names the flag; the old command names are errors that name the new
# ones; `plan` shows first within 480 s and second within 210 s, and reports a budget they do
# not fit; `second` on a build directory without first's binaries stops at once with exit 3
# (a cold machine), writing only its summary into --out. Prints PASS: / FAIL: lines.
set -uo pipefail
GC="$1"
fail() { echo "FAIL: $*"; exit 1; }
out="$("$GC" --help)" || fail "--help exited $?"
grep -q '^usage: launch/gpu-check COMMAND' <<<"$out" || fail "--help printed no usage"
for w in fetch first second plan --out --budget build-gpu-deps; do
  grep -q -- "$w" <<<"$out" || fail "--help does not mention $w"
done
err="$("$GC" first --out 2>&1 >/dev/null)"; rc=$?
[ "$rc" -eq 2 ] || fail "'first --out' exited $rc"
[ "$(wc -l <<<"$err")" -eq 1 ] && grep -q -- '--out' <<<"$err" || fail "'first --out' said: $err"
err="$("$GC" first --frobnicate 2>&1 >/dev/null)"; rc=$?
[ "$rc" -eq 2 ] && grep -q -- '--frobnicate' <<<"$err" || fail "unknown flag: exit $rc: $err"
err="$("$GC" first 2>&1 >/dev/null)"; rc=$?
[ "$rc" -eq 2 ] && grep -q -- '--out' <<<"$err" || fail "first without --out: exit $rc: $err"
for old in core sanitize extended; do
  err="$("$GC" "$old" --out /nonexistent 2>&1 >/dev/null)"; rc=$?
  [ "$rc" -eq 2 ] && grep -q "'first'" <<<"$err" && grep -q "'second'" <<<"$err" ||
    fail "'$old': exit $rc: $err"
done
plan="$("$GC" plan)" || fail "plan exited $? at the default budgets"
grep -qE '^  total .* <= 480 s: fits$' <<<"$plan" || fail "first does not fit 480 s: $plan"
grep -qE '^  total .* <= 210 s: fits$' <<<"$plan" || fail "second does not fit 210 s: $plan"
"$GC" plan --budget 300 >/dev/null && fail "plan accepted a budget the items do not fit"
# A cold machine: second finds no build of first's and stops before any item.
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
err="$("$GC" second --out "$tmp/out" --build-dir "$tmp/build" 2>&1 >/dev/null)"; rc=$?
[ "$rc" -eq 3 ] && grep -q 'cold machine.*run the first command again' <<<"$err" ||
  fail "second on a cold machine: exit $rc: $err"
[ "$(ls "$tmp/out")" = summary.txt ] || fail "second on a cold machine left: $(ls "$tmp/out")"
[ ! -e "$tmp/build" ] || fail "second on a cold machine created its build directory"
echo "PASS: gpu-check command line"
