# Integration tests: start a real kvtierd (port 0, temp data dir) and drive it.

# A client for grpc.health.v1.Health (Debian ships no health.proto).
set(HEALTH_GEN ${CMAKE_BINARY_DIR}/tests/proto)
add_custom_command(
  OUTPUT ${HEALTH_GEN}/health.pb.cc ${HEALTH_GEN}/health.grpc.pb.cc
         ${HEALTH_GEN}/health.pb.h ${HEALTH_GEN}/health.grpc.pb.h
  COMMAND ${CMAKE_COMMAND} -E make_directory ${HEALTH_GEN}
  COMMAND ${Protobuf_PROTOC_EXECUTABLE} --proto_path=${CMAKE_CURRENT_SOURCE_DIR}/proto
          --cpp_out=${HEALTH_GEN} --grpc_out=${HEALTH_GEN}
          --plugin=protoc-gen-grpc=${GRPC_CPP_PLUGIN}
          ${CMAKE_CURRENT_SOURCE_DIR}/proto/health.proto
  DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/proto/health.proto)

add_library(kvtier_daemon_support STATIC support/daemon_process.cc support/stalling_proxy.cc
            ${HEALTH_GEN}/health.pb.cc ${HEALTH_GEN}/health.grpc.pb.cc)
target_include_directories(kvtier_daemon_support PUBLIC ${HEALTH_GEN})
target_link_libraries(kvtier_daemon_support PUBLIC kvtier_client absl::strings absl::status
                      absl::statusor absl::synchronization)
target_compile_definitions(kvtier_daemon_support PUBLIC
  KVTIERD_PATH="$<TARGET_FILE:kvtierd>" KVTIER_CLI_PATH="$<TARGET_FILE:kvtier>")
add_dependencies(kvtier_daemon_support kvtierd kvtier)

kvtier_test(daemon_integration_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(daemon_bad_input_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(hint_events_integration_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(tenant_isolation_test LIBS kvtier_daemon_support kvtier_server LABELS integration)
kvtier_test(tenant_quota_test LIBS kvtier_daemon_support kvtier_server LABELS integration)
kvtier_test(daemon_process_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(tls_integration_test LIBS kvtier_daemon_support LABELS integration)
target_compile_definitions(tls_integration_test PRIVATE
  KVTIER_CERT_SCRIPT="${CMAKE_SOURCE_DIR}/tests/tls/make_test_certs.sh")
# Get into GPU memory through an in-process server on the fake device backend.
kvtier_test(device_get_test LIBS kvtier_server kvtier_daemon_support LABELS integration)

# A worker on a real GPU against a real kvtierd (CUDA IPC needs two processes): label
# `gpu`; each test skips without one.
if(KVTIER_HAVE_CUDA)
  kvtier_test(daemon_gpu_test LIBS kvtier_daemon_support CUDA::cudart_static LABELS gpu)
  if(KVTIER_HAVE_CUDA_KERNELS)
    target_compile_definitions(daemon_gpu_test PRIVATE KVTIER_HAVE_CUDA_KERNELS=1)
  endif()
endif()

kvtier_test(daemon_config_test LIBS kvtier_server)
kvtier_test(tenant_auth_test LIBS kvtier_server)
kvtier_test(stall_reaper_test LIBS kvtier_server)
kvtier_test(lease_table_test LIBS kvtier_server)
kvtier_test(stream_limiter_test LIBS kvtier_server)
kvtier_test(send_turns_test LIBS kvtier_server)
# Gets taking turns in an in-process server.
kvtier_test(get_turns_test LIBS kvtier_server kvtier_daemon_support LABELS integration)
# Put, Get and Prefill calls whose token is revoked mid-call, in an in-process server.
kvtier_test(revoked_credentials_test LIBS kvtier_server kvtier_daemon_support LABELS integration)
# The unary methods' bounded pool, in an in-process server.
kvtier_test(unary_pool_test LIBS kvtier_server kvtier_daemon_support LABELS integration)
kvtier_test(region_table_test LIBS kvtier_server)
target_compile_definitions(daemon_config_test PRIVATE KVTIER_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
kvtier_test(daemon_full_disk_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(cli_integration_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(metrics_integration_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(prefill_session_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(prefill_client_test LIBS kvtier_daemon_support LABELS integration)
kvtier_test(shm_integration_test LIBS kvtier_daemon_support LABELS integration)

# A real Redis Cluster on loopback (tests/support/redis_cluster_process) for the shared
# tier's tests.
add_library(kvtier_redis_support STATIC support/redis_cluster_process.cc)
target_link_libraries(kvtier_redis_support PUBLIC kvtier_daemon_support kvtier_storage)
# Certificates for TLS clusters (MakeRedisTestCerts).
target_compile_definitions(kvtier_redis_support PRIVATE
  KVTIER_CERT_SCRIPT="${CMAKE_SOURCE_DIR}/tests/tls/make_test_certs.sh")
kvtier_test(redis_cluster_test LIBS kvtier_redis_support LABELS integration redis)
kvtier_test(remote_tier_test LIBS kvtier_redis_support LABELS integration redis)
# The StorageTier contract on every tier (the remote one on a real cluster).
kvtier_test(storage_tier_test LIBS kvtier_redis_support LABELS redis)
kvtier_test(shared_tier_integration_test LIBS kvtier_redis_support LABELS integration redis)
