# Debian package for kvtier: `cpack -G DEB` in the build directory writes
# kvtier_<version>_<arch>.deb. Included from the top-level CMakeLists.txt.
#
# Contents: /usr/bin/kvtierd and /usr/bin/kvtier (install rules in server/ and client/),
# /usr/share/kvtier/kvtierd.toml (the example with built-in defaults),
# /etc/kvtier/kvtierd.toml (conffile: the example with data_dir=/var/lib/kvtier) and
# /lib/systemd/system/kvtierd.service (deploy/CMakeLists.txt), and the Python client
# package in /usr/lib/python3/dist-packages/kvtier (client/python/CMakeLists.txt). The maintainer scripts in
# deploy/debian/ create the `kvtier` user on install and delete it, with /var/lib/kvtier,
# on purge.

set(CPACK_PACKAGE_NAME kvtier)
set(CPACK_PACKAGE_VENDOR kvtier)
set(CPACK_PACKAGE_CONTACT "kvtier maintainers <kvtier@localhost>")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "KV-cache server for LLM inference (kvtierd)")
set(CPACK_PACKAGE_DESCRIPTION
    "kvtierd keeps the KV cache that earlier inference requests computed, in a host-RAM\n\
pool backed by RocksDB on local SSD, and serves it to inference workers over gRPC.\n\
Includes the kvtier command-line client and a hardened systemd unit (kvtierd.service).")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
# The absolute install destinations (/etc/kvtier, /lib/systemd/system) land in the
# package's tree as they are; the DEB generator stages them, nothing touches this host.
set(CPACK_STRIP_FILES ON)

set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
# Runtime libraries come from dpkg-shlibdeps (needs `file` and dpkg-dev, both in
# scripts/deps.sh). adduser is what postinst/postrm use (they fall back to useradd).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "adduser")
# The Python client (/usr/lib/python3/dist-packages/kvtier) needs these to import.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "python3, python3-numpy, python3-protobuf, python3-xxhash")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${CMAKE_CURRENT_LIST_DIR}/debian/conffiles
    ${CMAKE_CURRENT_LIST_DIR}/debian/postinst
    ${CMAKE_CURRENT_LIST_DIR}/debian/prerm
    ${CMAKE_CURRENT_LIST_DIR}/debian/postrm)
# Scripts 0755, conffiles 0644, whatever the checkout's modes are.
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)

set(CPACK_GENERATOR DEB)
include(CPack)
