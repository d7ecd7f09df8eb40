# Decides whether the CUDA backend is built and wires it into a target.
include(CheckLanguage)

set(CONVEYOR_WITH_CUDA OFF)
string(TOUPPER "${CONVEYOR_CUDA}" _conveyor_cuda_mode)
if(NOT _conveyor_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "CONVEYOR_CUDA must be AUTO, ON or OFF, got '${CONVEYOR_CUDA}'")
endif()

if(NOT _conveyor_cuda_mode STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures (90 = H100/H200)")
  endif()
  check_language(CUDA)
  find_package(CUDAToolkit QUIET)
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
    enable_language(CUDA)
    # CMake 3.25 knows no C++20 flag for nvcc, so C++20 targets with .cu sources fail to
    # configure; nvcc 12+ accepts -std=c++20.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    find_package(NCCL)
    if(NCCL_FOUND)
      set(CONVEYOR_WITH_CUDA ON)
    elseif(_conveyor_cuda_mode STREQUAL "ON")
      message(FATAL_ERROR "CONVEYOR_CUDA=ON but NCCL was not found (set NCCL_ROOT)")
    else()
      message(STATUS "Conveyor: CUDA toolkit found but NCCL missing; building CPU only")
    endif()
  elseif(_conveyor_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "CONVEYOR_CUDA=ON but no CUDA compiler/toolkit was found")
  endif()
endif()
message(STATUS "Conveyor: CUDA backend ${CONVEYOR_WITH_CUDA}")

# Wires the CUDA backend into one layer's target: the definition every layer above sees, the
# static runtime (binaries built here stay runnable on the GPU machine), and nvcc's flags for
# the layer's own .cu files. Libraries beyond the runtime (cuBLASLt, NCCL) are linked by the
# layer that calls them.
function(conveyor_enable_cuda target)
  if(NOT CONVEYOR_WITH_CUDA)
    return()
  endif()
  target_compile_definitions(${target} PUBLIC CONVEYOR_WITH_CUDA=1)
  target_link_libraries(${target} PUBLIC CUDA::cudart_static)
  if(ARGN)
    set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
                                               CUDA_RESOLVE_DEVICE_SYMBOLS ON)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xcompiler=-Wall>)
  endif()
endfunction()
