# Integration tests: start a real kvtierd (port 0, temp data dir) and drive it.
add_library(kvtier_daemon_support STATIC support/daemon_process.cc)
target_link_libraries(kvtier_daemon_support PUBLIC kvtier_client absl::strings absl::status
                      absl::statusor)
target_compile_definitions(kvtier_daemon_support PUBLIC
  KVTIERD_PATH="$<TARGET_FILE:kvtierd>" KVTIER_CLI_PATH="$<TARGET_FILE:kvtier>")
add_dependencies(kvtier_daemon_support kvtierd kvtier)

kvtier_test(daemon_integration_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(daemon_bad_input_test LIBS kvtier_daemon_support LABELS integration)

kvtier_test(daemon_config_test LIBS kvtier_server)
target_compile_definitions(daemon_config_test PRIVATE KVTIER_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
kvtier_test(daemon_full_disk_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(cli_integration_test LIBS kvtier_daemon_support LABELS integration)
