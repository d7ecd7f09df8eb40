# Installs the library, its public headers and a CMake package so that applications can use
# find_package(conveyor), link conveyor::conveyor and include "conveyor/engine/conveyor.h".
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

# Applications reach the headers under a conveyor/ prefix, so that an application folder named
# engine/ or layers/ cannot stand in for ours (nor ours for its). Inside the source tree the
# includes are relative to the source root; the public copies, generated here into
# include/conveyor/ of the build tree, have each project include rewritten with the prefix.
# The examples build against these copies and the install ships them, so both see the same text.
set(CONVEYOR_PUBLIC_INCLUDE_DIR ${PROJECT_BINARY_DIR}/include)
set(_public_root ${CONVEYOR_PUBLIC_INCLUDE_DIR}/conveyor)
set(_generated)
foreach(_header ${CONVEYOR_PUBLIC_HEADERS})
  file(READ ${PROJECT_SOURCE_DIR}/${_header} _text)
  string(REGEX REPLACE "(#[ \t]*include[ \t]*\")" "\\1conveyor/" _text "${_text}")
  set(_copy ${_public_root}/${_header})
  list(APPEND _generated ${_copy})
  set(_old_text)
  if(EXISTS ${_copy})
    file(READ ${_copy} _old_text)
  endif()
  # Rewritten only when it changed, so that a reconfigure does not rebuild the examples.
  if(NOT _text STREQUAL _old_text)
    file(WRITE ${_copy} "${_text}")
  endif()
  get_filename_component(_dir ${_header} DIRECTORY)
  install(FILES ${_copy} DESTINATION include/conveyor/${_dir})
endforeach()
# A header that left the public set must not linger where the examples would still find it.
file(GLOB_RECURSE _present ${_public_root}/*)
foreach(_copy ${_present})
  if(NOT _copy IN_LIST _generated)
    file(REMOVE ${_copy})
  endif()
endforeach()
target_include_directories(conveyor INTERFACE $<BUILD_INTERFACE:${CONVEYOR_PUBLIC_INCLUDE_DIR}>)

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
