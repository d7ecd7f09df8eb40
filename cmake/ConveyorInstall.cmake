# Installs the library, its headers and a CMake package so that applications can use
# find_package(conveyor) and link conveyor::conveyor.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

foreach(_dir engine layers kernels comm)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${_dir}/ DESTINATION include/conveyor/${_dir}
          FILES_MATCHING PATTERN "*.h")
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
