#!/usr/bin/env bash
# clang-format over the project's C++ sources (.clang-format at the root).
#   scripts/format.sh            reformat every tracked source in place
#   scripts/format.sh --check    list the files that differ from the format; exit 1 if any do
#   scripts/format.sh --tidy F…  clang-tidy (.clang-tidy) on files F… via build/default/compile_commands.json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fmt=$(command -v clang-format-14 || command -v clang-format || true)
[ -n "$fmt" ] || { echo "format.sh: clang-format not found (apt-get install clang-format)" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh')
case "${1:-}" in
  --check)
    bad=0
    for f in "${files[@]}"; do
      if ! "$fmt" "$f" | cmp -s - "$f"; then echo "not formatted: $f"; bad=1; fi
    done
    exit $bad ;;
  --tidy)
    shift
    tidy=$(command -v clang-tidy-14 || command -v clang-tidy)
    exec "$tidy" -p build/default "$@" ;;
  "")
    "$fmt" -i "${files[@]}" ;;
  *) echo "usage: scripts/format.sh [--check | --tidy FILE...]" >&2; exit 2 ;;
esac
