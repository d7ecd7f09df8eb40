#!/usr/bin/env bash
# The library's messages speak of its own API (TrainConfig::stages, Device::cpu()), never of
# the command line's flags, which a program linking it does not have: no string literal under
# engine/, layers/, comm/ or kernels/ holds a flag such as --lr (comments may name them).
# The command line shows those names as its flags (tools/flag_terms.h).
# Usage: library_messages.sh SOURCE_DIR
set -u
root=${1:?usage: library_messages.sh SOURCE_DIR}
cd "$root" || exit 1
# A literal's text holding " --x" or "(--x" or starting with "--x"; comment lines left out.
found=$(grep -rnE --include='*.cpp' --include='*.h' --include='*.cu' --include='*.cuh' \
  '"([^"\\]|\\.)*(^|[ (`"])--[a-z]([^"\\]|\\.)*"' engine layers comm kernels |
  grep -vE '^[^:]+:[0-9]+:[[:space:]]*//')
if [[ -n "$found" ]]; then
  echo "$found"
  echo "library_messages: $(wc -l <<<"$found") library string(s) above name a command-line flag; name the API's setting instead" >&2
  exit 1
fi
echo "library_messages: no library string names a command-line flag"
