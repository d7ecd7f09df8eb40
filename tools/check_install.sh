#!/usr/bin/env bash
# Installs a built Conveyor into a scratch prefix and checks it as an application sees it:
#   - only public headers are installed (no *_check.h, *_guard.h or *.cuh);
#   - every installed header compiles on its own against the installed tree, as
#     "conveyor/<path>", without a warning of -Wall -Wextra -Wpedantic, in a project whose own
#     folders hold headers of the same paths and that cannot find Eigen (a dependency of the
#     build only);
#   - each example under examples/ builds through find_package(conveyor) and runs.
# Usage: tools/check_install.sh BUILD_DIR WORK_DIR
# WORK_DIR is removed and made anew, so it must be new, empty or one an earlier check made (it
# holds .conveyor_check_install): a folder of the user's, given by mistake, is refused.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if (($# != 2)); then
  echo "usage: tools/check_install.sh BUILD_DIR WORK_DIR (WORK_DIR is removed and made anew)" >&2
  exit 2
fi
build=$1
work=$2
if [[ ! -f "$build/cmake_install.cmake" ]]; then
  echo "check_install: BUILD_DIR '$build' is not a configured build folder (no cmake_install.cmake)" >&2
  exit 2
fi
marker=.conveyor_check_install
if [[ -e "$work" || -L "$work" ]]; then
  # A check made before the marker existed left prefix/ with the installed header in it.
  if [[ ! -d "$work" || -L "$work" ]]; then
    echo "check_install: WORK_DIR '$work' exists and is not a folder (a link is not followed)" >&2
    exit 2
  fi
  if [[ -n "$(ls -A "$work")" && ! -f "$work/$marker" &&
        ! -f "$work/prefix/include/conveyor/engine/conveyor.h" ]]; then
    echo "check_install: WORK_DIR '$work' already holds files this check did not write, and it" \
         "removes WORK_DIR: give a new or empty folder" >&2
    exit 2
  fi
fi
rm -rf "$work"
mkdir -p "$work"
: >"$work/$marker"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
include=$prefix/include/conveyor

internal=$(cd "$include" && find . -name '*_check.h' -o -name '*_guard.h' -o -name '*.cuh')
if [[ -n "$internal" ]]; then
  echo "check_install: internal headers were installed:" $internal >&2
  exit 1
fi
[[ -f "$include/engine/conveyor.h" ]] || { echo "check_install: engine/conveyor.h missing" >&2; exit 1; }

# One object per installed header, each including that header alone. The project has a
# header of its own at each path Conveyor's headers have (engine/core/tensor.h, ...), ahead
# of Conveyor's on the include path: an installed header that reached one of those instead
# of its own would stop the build.
headers_project=$work/headers
mkdir -p "$headers_project"
(cd "$include" && find . -name '*.h') | while read -r header; do
  header=${header#./}
  mkdir -p "$headers_project/$(dirname "$header")"
  echo "#error \"the application's own $header was taken for Conveyor's\"" \
    >"$headers_project/$header"
done
{
  echo "cmake_minimum_required(VERSION 3.25)"
  echo "project(conveyor_headers LANGUAGES CXX)"
  echo "find_package(conveyor REQUIRED)"
  echo "add_library(headers OBJECT"
  (cd "$include" && find . -name '*.h' | sort) | while read -r header; do
    header=${header#./}
    source=$headers_project/${header//\//_}.cpp
    echo "#include \"conveyor/$header\"" >"$source"
    echo "  $source"
  done
  echo ")"
  echo "target_include_directories(headers PRIVATE \${CMAKE_CURRENT_SOURCE_DIR})"
  echo "target_link_libraries(headers PRIVATE conveyor::conveyor)"
  # As an application that builds with warnings as errors and reaches the headers by a plain
  # -I (not the -isystem CMake gives imported targets, which hides their warnings) sees them.
  echo "set_target_properties(headers PROPERTIES NO_SYSTEM_FROM_IMPORTED ON)"
  echo "target_compile_options(headers PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Wconversion"
  echo "                       -Wsign-conversion -Werror)"
} >"$headers_project/CMakeLists.txt"
# Eigen is left unfindable: the library's kernels use it, but no installed header includes it,
# so an application must not need it to find the package.
cmake -S "$headers_project" -B "$work/headers-build" -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_DISABLE_FIND_PACKAGE_Eigen3=TRUE --no-warn-unused-cli >/dev/null
cmake --build "$work/headers-build" -j2 >/dev/null
echo "check_install: $(cd "$include" && find . -name '*.h' | wc -l) installed headers compile on their own, without warnings"

# The components are the build's optional backends: one it lacks, or one that does not
# exist, is refused at configure time with the reason.
components=$work/components
mkdir -p "$components"
cat >"$components/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(conveyor_components LANGUAGES CXX)
find_package(conveyor COMPONENTS nope)
message(STATUS "component nope: ${conveyor_FOUND}")
find_package(conveyor COMPONENTS cuda)
message(STATUS "component cuda: ${conveyor_FOUND}")
EOF
output=$(cmake -S "$components" -B "$work/components-build" -DCMAKE_PREFIX_PATH="$prefix" 2>&1)
wants=("conveyor has no component 'nope' (its components are cuda and mpi)" "component nope: 0")
if grep -q '^set(CONVEYOR_WITH_CUDA ON)$' "$(find "$prefix" -name conveyorConfig.cmake)"; then
  wants+=("component cuda: 1")
else
  wants+=("this conveyor was built without the CUDA backend" "component cuda: 0")
fi
for want in "${wants[@]}"; do
  if ! grep -qF -- "$want" <<<"$output"; then
    echo "$output" >&2
    echo "check_install: find_package(conveyor COMPONENTS ...) did not say \"$want\"" >&2
    exit 1
  fi
done
echo "check_install: find_package(conveyor COMPONENTS ...) knows cuda and mpi, and says why not"

for example in minimal_train custom_model checkpoint_resume; do
  cmake -S "$root/examples/$example" -B "$work/$example" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
  cmake --build "$work/$example" -j2 >/dev/null
  echo "check_install: running $example"
  "$work/$example/$example"
done
# A data file that cannot be used is caught by its type from the installed headers (a folder
# and an empty file are InputFileErrors, a file shorter than a batch an invalid_argument):
# minimal_train says why and exits 2, where an exception it missed would abort it.
: >"$work/empty.txt"
printf 'abc' >"$work/short.txt"
for data in "$work" "$work/empty.txt" "$work/short.txt"; do
  status=0
  "$work/minimal_train/minimal_train" "$data" 2>"$work/minimal_train.err" || status=$?
  if [ "$status" != 2 ] || ! grep -q "^minimal_train: data file" "$work/minimal_train.err"; then
    echo "check_install: minimal_train given $data as its data file: status $status," \
         "$(cat "$work/minimal_train.err")" >&2
    exit 1
  fi
done
echo "check_install: minimal_train refuses a folder, an empty and a short data file"
