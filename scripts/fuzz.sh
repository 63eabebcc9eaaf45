#!/usr/bin/env bash
# Runs every libFuzzer target of a `fuzz` preset build for a fixed time each (`make fuzz`):
# each starts from its corpus (fuzz/CMakeLists.txt: seeds, the bad-inputs corpus of its kind, its
# findings) copied into a working corpus that grows, under AddressSanitizer and
# UndefinedBehaviorSanitizer. A crash, leak, sanitizer report, uncaught exception or an input
# slower than 10 s is written to <build>/fuzz-findings/<target>/; copy it into
# fuzz/findings/<target>/ once fixed, and ctest replays it from then on. One line per target
# goes to <build>/fuzz-summary.txt: seconds, executions, coverage, findings.
#
# usage: scripts/fuzz.sh BUILD_DIR SECONDS_PER_TARGET [TARGET...]
set -euo pipefail
if [[ $# -lt 2 ]]; then echo "usage: $0 BUILD_DIR SECONDS_PER_TARGET [TARGET...]" >&2; exit 2; fi
build="$1"
seconds="$2"
shift 2
corpora="$build/fuzz_corpora.txt"
[[ -f "$corpora" ]] || { echo "fuzz.sh: no $corpora (configure and build the fuzz preset first)" >&2; exit 2; }
mapfile -t targets < <(cut -f1 "$corpora" | uniq)
for t in "$@"; do
  [[ " ${targets[*]} " == *" $t "* ]] || { echo "fuzz.sh: no target $t (there are: ${targets[*]})" >&2; exit 2; }
done
[[ $# -gt 0 ]] && targets=("$@")
summary="$build/fuzz-summary.txt"
: > "$summary"
status=0
# Leaks are findings; undefined behaviour aborts (the preset also compiles with
# -fno-sanitize-recover=undefined).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
for target in "${targets[@]}"; do
  bin="$build/fuzz/fuzz_$target"
  [[ -x "$bin" ]] || { echo "fuzz.sh: no $bin (cmake --build --preset fuzz --target fuzz_targets)" >&2; exit 2; }
  work="$build/fuzz-corpus/$target"
  findings="$build/fuzz-findings/$target"
  # An earlier run's findings are kept aside, so that this run counts only its own.
  if [[ -d "$findings" ]] && [[ -n "$(ls -A "$findings")" ]]; then
    rm -rf "$findings.previous" && mv "$findings" "$findings.previous"
  fi
  mkdir -p "$work" "$findings"
  while IFS=$'\t' read -r t input; do  # seed the working corpus (dot files are not inputs)
    [[ "$t" == "$target" ]] || continue
    if [[ -d "$input" ]]; then
      find "$input" -type f ! -name '.*' -print0 | while IFS= read -r -d '' f; do
        [[ -e "$work/${f##*/}" ]] || cp "$f" "$work/"
      done
    elif [[ -f "$input" ]]; then
      [[ -e "$work/${input##*/}" ]] || cp "$input" "$work/"
    fi
  done < "$corpora"
  log="$build/fuzz-$target.log"
  echo "fuzz.sh: $target for ${seconds} s ($(ls "$work" | wc -l) inputs to start from)"
  rc=0
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=131072 -print_final_stats=1 \
    -artifact_prefix="$findings/" "$work" < /dev/null > "$log" 2>&1 || rc=$?
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo "?")
  found=$(find "$findings" -type f | wc -l)
  line="$target: ${seconds} s, ${runs} executions, coverage ${cov} edges, corpus $(ls "$work" | wc -l) inputs, ${found} finding(s), exit ${rc}"
  echo "$line" | tee -a "$summary"
  if [[ $rc -ne 0 || $found -ne 0 ]]; then status=1; tail -30 "$log" >&2; fi
done
echo "fuzz.sh: summary in $summary"
exit $status
