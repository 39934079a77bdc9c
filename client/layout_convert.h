// Conversion between kvtier::LayoutSpec (the storage library's value type) and
// kvtier.v1.Layout (the wire message). Shared by the client and the daemon, so it
// depends only on kvtier_proto and kvtier_chunk_key.
//
// Thread-safety: pure functions.
#ifndef KVTIER_CLIENT_LAYOUT_CONVERT_H_
#define KVTIER_CLIENT_LAYOUT_CONVERT_H_

#include "absl/status/statusor.h"
#include "kvtier/v1/kvtier.pb.h"
#include "storage/layout_spec.h"

namespace kvtier {

// Field-for-field copy; the enum values of LayoutSpec match the proto's. Does not
// validate: an invalid spec gives an equally invalid message (useful in tests that
// check the server's validation).
v1::Layout LayoutToProto(const LayoutSpec& spec);

// The inverse, followed by LayoutSpec::Validate(), so the result is always a layout the
// daemon can serve. Proto3 enums are open, so unknown dtype / key_position values are
// rejected here rather than truncated.
// Returns: Ok, InvalidArgument (naming the bad field as "layout.<field> ...").
absl::StatusOr<LayoutSpec> LayoutFromProto(const v1::Layout& layout);

}  // namespace kvtier

#endif  // KVTIER_CLIENT_LAYOUT_CONVERT_H_
