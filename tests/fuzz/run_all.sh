#!/usr/bin/env bash
# Run every fuzz target for a budget and print the figures (executions, seconds, exec/s, crashes).
#
#   tests/fuzz/run_all.sh                      # 1,000,000 executions per target, at most 1 hour each
#   RUNS=200000 SECONDS_PER_TARGET=300 tests/fuzz/run_all.sh
#   TARGETS="gguf npy" tests/fuzz/run_all.sh
#
# Logs and any crash inputs go to $OUT (default /tmp/squishlike-fuzz-out). Exit status 1 if any target crashed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
RUNS=${RUNS:-1000000}
SECONDS_PER_TARGET=${SECONDS_PER_TARGET:-3600}
OUT=${OUT:-/tmp/squishlike-fuzz-out}
TARGETS=${TARGETS:-"safetensors index config mlx_config gguf ollama npy manifest sentinel side_files tier_files kernels"}
mkdir -p "$OUT"
status=0
printf '%-12s %12s %9s %9s  %s\n' target executions seconds exec/s result
for t in $TARGETS; do
  if [ "$t" = kernels ]; then
    cmd=("$PY" -m fuzz.fuzz_kernels)
  else
    cmd=("$PY" -m fuzz.fuzz_parsers "$t")
  fi
  "${cmd[@]}" -runs="$RUNS" -max_total_time="$SECONDS_PER_TARGET" -timeout=20 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$OUT/$t-" >"$OUT/$t.log" 2>&1
  rc=$?
  ws=$(grep -ao 'workspace [^,]*' "$OUT/$t.log" | head -1 | awk '{print $2}')
  case "$ws" in /dev/shm/squishlike-fuzz-*|/tmp/squishlike-fuzz-*) rm -rf "$ws" ;; esac
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$OUT/$t.log" | grep -o '[0-9]*$' | tail -1)
  secs=$(grep -o 'Done [0-9]* runs in [0-9]* second' "$OUT/$t.log" | awk '{print $5}' | tail -1)
  [ -z "$secs" ] && secs=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$OUT/$t.log" | grep -o '[0-9]*$' | tail -1 | \
    awk -v e="${execs:-0}" '{ if ($1 > 0) printf "%d", e / $1; else print "?" }')
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$OUT/$t.log" | grep -o '[0-9]*$' | tail -1)
  if [ $rc -eq 0 ]; then result="0 crashes, 0 hangs"; else result="CRASH or HANG (rc $rc), see $OUT/$t.log"; status=1; fi
  printf '%-12s %12s %9s %9s  %s\n' "$t" "${execs:-?}" "${secs:-?}" "${rate:-?}" "$result"
done
exit $status
