# Installs the library, its public headers and a CMake package so that applications can use
# find_package(conveyor), link conveyor::conveyor and include "engine/conveyor.h".
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The public headers: engine/conveyor.h and every project header it includes, directly or
# through others, found by following the #include "..." lines (so the installed tree is
# exactly what the umbrella needs). Headers internal to the implementation — the call-check
# macros (*_check.h), device guards (*_guard.h) and CUDA device code (*.cuh) — must not be
# among them: a public header that needs one should include it from its .cpp instead.
set(_conveyor_internal_header "(_check\\.h|_guard\\.h|\\.cuh)$")
set(_pending engine/conveyor.h)
set(CONVEYOR_PUBLIC_HEADERS)
while(_pending)
  list(POP_FRONT _pending _header)
  if(_header IN_LIST CONVEYOR_PUBLIC_HEADERS)
    continue()
  endif()
  list(APPEND CONVEYOR_PUBLIC_HEADERS ${_header})
  set(_path ${PROJECT_SOURCE_DIR}/${_header})
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_path})
  file(STRINGS ${_path} _includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(_line ${_includes})
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" _included "${_line}")
    if(_included MATCHES "${_conveyor_internal_header}")
      message(FATAL_ERROR "public header ${_header} includes the internal header ${_included}; "
                          "include it from the .cpp that needs it")
    endif()
    if(NOT EXISTS ${PROJECT_SOURCE_DIR}/${_included})
      message(FATAL_ERROR "public header ${_header} includes \"${_included}\", which is not a "
                          "header of the project (includes are relative to the source root)")
    endif()
    list(APPEND _pending ${_included})
  endforeach()
endwhile()
list(SORT CONVEYOR_PUBLIC_HEADERS)
foreach(_header ${CONVEYOR_PUBLIC_HEADERS})
  get_filename_component(_dir ${_header} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${_header} DESTINATION include/conveyor/${_dir})
endforeach()

get_property(_layers GLOBAL PROPERTY CONVEYOR_LAYER_TARGETS)
install(TARGETS conveyor ${_layers} EXPORT conveyorTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(EXPORT conveyorTargets NAMESPACE conveyor:: FILE conveyorTargets.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/conveyor)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/conveyorConfig.cmake.in
  ${PROJECT_BINARY_DIR}/conveyorConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/conveyor)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/conveyorConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/conveyorConfig.cmake
              ${PROJECT_BINARY_DIR}/conveyorConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/conveyor)
