# Unit tests: one executable per file, registered with kvtier_test (tests/CMakeLists.txt).

# Storage layer.
kvtier_test(chunk_key_test LIBS kvtier_chunk_key protobuf::libprotobuf)
# The one vector file every client's tests load.
target_compile_definitions(chunk_key_test PRIVATE
  KVTIER_VECTORS_FILE="${CMAKE_SOURCE_DIR}/tests/vectors/chunk_keys.json")
kvtier_test(async_gate_test LIBS kvtier_storage)
kvtier_test(fair_gate_test LIBS kvtier_storage)
kvtier_test(crc32c_test LIBS kvtier_storage)
kvtier_test(parallel_copy_test LIBS kvtier_storage)
kvtier_test(lru_policy_test LIBS kvtier_storage)
kvtier_test(prefix_cost_policy_test LIBS kvtier_storage)
kvtier_test(hint_window_test LIBS kvtier_storage)
kvtier_test(event_log_test LIBS kvtier_storage)
kvtier_test(log_limiter_test LIBS kvtier_storage)
kvtier_test(rocksdb_logger_test LIBS kvtier_storage)
kvtier_test(prefetcher_test LIBS kvtier_storage)
kvtier_test(tiered_store_hint_test LIBS kvtier_storage)
kvtier_test(host_pool_test LIBS kvtier_storage)
kvtier_test(write_back_flusher_test LIBS kvtier_storage)
kvtier_test(put_admission_test LIBS kvtier_storage)
kvtier_test(payload_log_test LIBS kvtier_storage)
kvtier_test(ssd_tier_test LIBS kvtier_storage)
kvtier_test(tiered_store_test LIBS kvtier_storage)
kvtier_test(promoter_test LIBS kvtier_storage)
kvtier_test(remote_record_test LIBS kvtier_storage)
kvtier_test(fetch_claims_test LIBS kvtier_storage)
kvtier_test(key_locks_test LIBS kvtier_storage)
kvtier_test(parallel_crc_test LIBS kvtier_storage)
kvtier_test(crc32c_gf2_test LIBS kvtier_storage)
kvtier_test(gpu_staging_tier_test LIBS kvtier_storage)
kvtier_test(enqueue_gate_test LIBS kvtier_storage)
kvtier_test(tiered_store_gpu_test LIBS kvtier_storage)
kvtier_test(scheduler_test LIBS kvtier_scheduler)

# Client internals.
kvtier_test(frame_parser_test LIBS kvtier_frame_parser)
kvtier_test(get_frame_checker_test LIBS kvtier_client)
# The client against a fake daemon whose answers break the layout (in-process server).
kvtier_test(client_protocol_test LIBS kvtier_client)
kvtier_test(allocator_tuning_test LIBS kvtier_client)

# The CUDA device backend on a real GPU: label `gpu`; each test skips without one.
if(KVTIER_HAVE_CUDA)
  kvtier_test(cuda_device_backend_test LABELS gpu LIBS kvtier_cuda)
  kvtier_test(cuda_raii_test LIBS kvtier_cuda CUDA::cudart_static)
endif()

# Server internals.
kvtier_test(tls_reloader_test LIBS kvtier_server)
kvtier_test(get_plan_test LIBS kvtier_server)
kvtier_test(unix_socket_path_test LIBS kvtier_server)
target_compile_definitions(tls_reloader_test PRIVATE
  KVTIER_CERT_SCRIPT="${CMAKE_SOURCE_DIR}/tests/tls/make_test_certs.sh")
