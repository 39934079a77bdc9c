# Checks of deploy/: the systemd unit, the Prometheus rules and the Debian package. Each
# runs tests/deploy_checks.sh and exits 77 (skipped) where a tool it needs is missing.
set(KVTIER_DEPLOY_CHECKS ${CMAKE_CURRENT_SOURCE_DIR}/deploy_checks.sh)

# kvtier_deploy_test(NAME COMMAND [ARGS...]): one subcommand of deploy_checks.sh.
function(kvtier_deploy_test name subcommand)
  add_test(NAME ${name}
           COMMAND bash ${KVTIER_DEPLOY_CHECKS} ${subcommand} ${CMAKE_SOURCE_DIR} ${ARGN})
  set_tests_properties(${name} PROPERTIES LABELS deploy SKIP_RETURN_CODE 77 TIMEOUT 120)
endfunction()

kvtier_deploy_test(deploy_unit_verify unit-verify $<TARGET_FILE:kvtierd>)
kvtier_deploy_test(deploy_unit_security unit-security)
kvtier_deploy_test(deploy_prometheus prometheus)
kvtier_deploy_test(deploy_alert_metric_names metric-names $<TARGET_FILE:kvtierd>)
kvtier_deploy_test(deploy_unit_shm unit-shm $<TARGET_FILE:kvtierd> $<TARGET_FILE:kvtier>)
# Installs and purges the package on this machine (root only). RUN_SERIAL: cpack first
# runs the build's `preinstall` step, which must not race other tests' binaries.
kvtier_deploy_test(deploy_deb deb ${CMAKE_BINARY_DIR})
set_tests_properties(deploy_deb PROPERTIES TIMEOUT 900 RUN_SERIAL TRUE)
