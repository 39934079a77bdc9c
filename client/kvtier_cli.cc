// kvtier: the command-line client of kvtierd. See kUsage below, or run `kvtier --help`.
//
// Exit status: 0 success, 1 failure (the daemon's error or a local I/O problem, named on
// stderr as "kvtier: COMMAND: CODE: message"), 2 usage error.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/kvtier_client.h"
#include "client/layout_convert.h"
#include "client/mapped_file.h"
#include "client/progress_meter.h"
#include "storage/chunk_key.h"
#include "storage/layout_spec.h"

namespace kvtier {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

constexpr char kDefaultTarget[] = "127.0.0.1:50051";

constexpr char kUsage[] =
    R"(Usage: kvtier [--target HOST:PORT] [--timeout SECONDS] COMMAND [OPTIONS] [ARGS...]

Command-line client of kvtierd, the tiered KV-cache daemon.

Commands:
  register --model-id M [--revision R] --dtype fp16|bf16|fp32|fp8e4m3|fp8e5m2
           --layers N --kv-heads N --head-dim N --tokens-per-chunk N
           [--tp-world-size N --tp-rank N] [--pre-rope] [--dry-run]
      Register a layout and print its namespace id and chunk size in bytes.
      --dry-run computes both locally without contacting the daemon.
  keys --namespace NS --tokens-per-chunk C --tokens-file F
      Print the key of each full chunk of the token ids in F (whitespace-separated
      unsigned 32-bit integers; "-" reads stdin), one per line. Works offline.
  put --namespace NS [--token-count N] KEYHEX=FILE...
      Store each FILE under KEYHEX. A FILE holds exactly one chunk: chunk size bytes,
      as printed by `register`.
  get --namespace NS [--layers B:E] KEYHEX=OUTFILE...
      Fetch chunks (or only layers [B, E) of each) into files, one chunk per file. A
      missing chunk is reported and makes the exit status 1; the other files are still
      written. OUTFILE /dev/stdout writes the chunk there (the report then goes to
      stderr); several keys may name it, or a device or FIFO: their chunks follow in turn.
  lookup --namespace NS KEYHEX...
      Show the tier holding each key, and the prefix hit length.
  pin --namespace NS [--ttl SECONDS] KEYHEX...
      Keep chunks in the RAM tier for SECONDS (default 0: until unpinned).
  unpin --namespace NS KEYHEX...
  delete --namespace NS KEYHEX...
  clear --namespace NS
      Remove every chunk of a namespace; the layout stays registered.
  stats
      Show the daemon's tiers and counters.

Global options:
  --target HOST:PORT   Daemon address, also unix:PATH (default 127.0.0.1:50051).
  --timeout SECONDS    Deadline of each request; a put or get counts as one (default 60).
  --tls-ca FILE        Use TLS, trusting these CA certificates (PEM) for the daemon.
  --tls-cert FILE      With --tls-key: a client certificate for mutual TLS.
  --tls-key FILE
  --tls-server-name N  The name to check in the daemon's certificate (default: host).
  --token-file FILE    Send the bearer token in FILE (first line) on every request.
  -h, --help           Show this help.

NS is a namespace id: 16 hex digits, optionally 0x-prefixed. KEYHEX is a chunk key:
32 hex digits. Transfers over 8 MiB show their progress on stderr when it is a
terminal; put and get always end with a summary line.

Exit status: 0 success, 1 failure, 2 usage error.
)";

// A usage error: exit status 2 and a pointer to --help.
struct UsageError {
  std::string message;
};

// ---------------------------------------------------------------------------------
// Command-line parsing.

// Options that never take a value.
const std::set<std::string>& BooleanOptions() {
  static const auto* kSet = new std::set<std::string>{"pre-rope", "dry-run", "help"};
  return *kSet;
}

// Options each command accepts, besides the global ones.
const std::map<std::string, std::set<std::string>>& CommandOptions() {
  static const auto* kMap = new std::map<std::string, std::set<std::string>>{
      {"register",
       {"model-id", "revision", "dtype", "layers", "kv-heads", "head-dim",
        "tokens-per-chunk", "tp-world-size", "tp-rank", "pre-rope", "dry-run"}},
      {"keys", {"namespace", "tokens-per-chunk", "tokens-file"}},
      {"put", {"namespace", "token-count"}},
      {"get", {"namespace", "layers"}},
      {"lookup", {"namespace"}},
      {"pin", {"namespace", "ttl"}},
      {"unpin", {"namespace"}},
      {"delete", {"namespace"}},
      {"clear", {"namespace"}},
      {"stats", {}},
  };
  return *kMap;
}

const std::set<std::string>& GlobalOptions() {
  static const auto* kSet = new std::set<std::string>{
      "target", "timeout", "help", "tls-ca", "tls-cert", "tls-key", "tls-server-name",
      "token-file"};
  return *kSet;
}

bool KnownOption(const std::string& name) {
  if (GlobalOptions().count(name)) return true;
  for (const auto& [command, options] : CommandOptions()) {
    if (options.count(name)) return true;
  }
  return false;
}

struct Args {
  std::string command;
  std::map<std::string, std::string> options;  // Name without "--" -> value.
  std::vector<std::string> positional;
  bool help = false;

  bool Has(const std::string& name) const { return options.count(name) > 0; }
  std::optional<std::string> Get(const std::string& name) const {
    auto it = options.find(name);
    if (it == options.end()) return std::nullopt;
    return it->second;
  }
};

// Parses "[global options] COMMAND [options] [args]"; options may appear anywhere, as
// "--name value" or "--name=value"; "--" ends options.
std::variant<Args, UsageError> ParseArgs(int argc, char** argv) {
  Args args;
  bool options_done = false;
  std::vector<std::string> loose;  // Positionals, command included.
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (options_done || arg.size() < 2 || arg[0] != '-') {
      loose.push_back(std::move(arg));
      continue;
    }
    if (arg == "--") {
      options_done = true;
      continue;
    }
    if (arg == "-h") {
      args.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) return UsageError{absl::StrCat("unknown option ", arg)};
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    if (!KnownOption(name)) return UsageError{absl::StrCat("unknown option --", name)};
    if (BooleanOptions().count(name)) {
      if (value.has_value()) return UsageError{absl::StrCat("--", name, " takes no value")};
      if (name == "help") {
        args.help = true;
        continue;
      }
      value = "";
    } else if (!value.has_value()) {
      // "--model-id --dtype fp16" is a forgotten value, not a model called "--dtype".
      if (i + 1 >= argc || absl::StartsWith(argv[i + 1], "--")) {
        return UsageError{absl::StrCat("--", name, " needs a value")};
      }
      value = argv[++i];
    }
    if (args.options.count(name)) return UsageError{absl::StrCat("--", name, " given twice")};
    args.options[name] = *value;
  }
  if (args.help) return args;
  if (loose.empty()) return UsageError{"no command given"};
  args.command = loose.front();
  args.positional.assign(loose.begin() + 1, loose.end());
  auto allowed = CommandOptions().find(args.command);
  if (allowed == CommandOptions().end()) {
    return UsageError{absl::StrCat("unknown command '", args.command, "'")};
  }
  for (const auto& [name, value] : args.options) {
    if (!allowed->second.count(name) && !GlobalOptions().count(name)) {
      return UsageError{absl::StrCat(args.command, ": unknown option --", name)};
    }
  }
  return args;
}

// Value parsers: each returns a UsageError naming the option.

std::variant<std::string, UsageError> Required(const Args& args, const std::string& name) {
  std::optional<std::string> v = args.Get(name);
  if (!v.has_value()) return UsageError{absl::StrCat("--", name, " is required")};
  if (v->empty()) return UsageError{absl::StrCat("--", name, " must not be empty")};
  return *v;
}

std::variant<uint32_t, UsageError> ParseU32(const std::string& what, const std::string& text) {
  uint32_t v = 0;
  // SimpleAtoi accepts a sign and surrounding spaces; a CLI number should be digits.
  if (text.empty() || !absl::c_all_of(text, absl::ascii_isdigit) ||
      !absl::SimpleAtoi(text, &v)) {
    return UsageError{absl::StrCat(what, " must be an unsigned 32-bit integer, got '",
                                   text, "'")};
  }
  return v;
}

std::variant<uint32_t, UsageError> RequiredU32(const Args& args, const std::string& name) {
  auto text = Required(args, name);
  if (auto* e = std::get_if<UsageError>(&text)) return *e;
  return ParseU32(absl::StrCat("--", name), std::get<std::string>(text));
}

std::variant<uint32_t, UsageError> OptionalU32(const Args& args, const std::string& name,
                                               uint32_t fallback) {
  std::optional<std::string> text = args.Get(name);
  if (!text.has_value()) return fallback;
  return ParseU32(absl::StrCat("--", name), *text);
}

// 16 hex digits, optionally 0x-prefixed.
std::variant<uint64_t, UsageError> ParseNamespace(const std::string& text) {
  absl::string_view digits = text;
  if (absl::StartsWith(digits, "0x") || absl::StartsWith(digits, "0X")) digits.remove_prefix(2);
  uint64_t v = 0;
  if (digits.size() != 16 || !absl::c_all_of(digits, absl::ascii_isxdigit) ||
      std::from_chars(digits.data(), digits.data() + digits.size(), v, 16).ec != std::errc()) {
    return UsageError{absl::StrCat(
        "--namespace must be 16 hex digits (optionally 0x-prefixed), got '", text, "'")};
  }
  return v;
}

std::variant<uint64_t, UsageError> RequiredNamespace(const Args& args) {
  auto text = Required(args, "namespace");
  if (auto* e = std::get_if<UsageError>(&text)) return *e;
  return ParseNamespace(std::get<std::string>(text));
}

// For commands that take no positional arguments.
std::optional<UsageError> NoPositional(const Args& args) {
  if (args.positional.empty()) return std::nullopt;
  return UsageError{absl::StrCat("unexpected argument '", args.positional[0], "'")};
}

std::variant<ChunkKey, UsageError> ParseKey(const std::string& text) {
  absl::StatusOr<ChunkKey> key = ChunkKey::FromHex(text);
  if (!key.ok()) {
    return UsageError{absl::StrCat("bad KEYHEX '", text, "': ", key.status().message())};
  }
  return *key;
}

std::variant<std::vector<ChunkKey>, UsageError> ParseKeys(const Args& args) {
  if (args.positional.empty()) return UsageError{"no KEYHEX given"};
  std::vector<ChunkKey> keys;
  for (const std::string& text : args.positional) {
    auto key = ParseKey(text);
    if (auto* e = std::get_if<UsageError>(&key)) return *e;
    keys.push_back(std::get<ChunkKey>(key));
  }
  return keys;
}

struct KeyAndPath {
  ChunkKey key;
  std::string path;
};

// KEYHEX=PATH arguments.
std::variant<std::vector<KeyAndPath>, UsageError> ParseKeyPaths(const Args& args,
                                                                const char* path_name) {
  if (args.positional.empty()) {
    return UsageError{absl::StrCat("no KEYHEX=", path_name, " given")};
  }
  std::vector<KeyAndPath> out;
  for (const std::string& arg : args.positional) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos || eq + 1 == arg.size()) {
      return UsageError{absl::StrCat("expected KEYHEX=", path_name, ", got '", arg, "'")};
    }
    auto key = ParseKey(arg.substr(0, eq));
    if (auto* e = std::get_if<UsageError>(&key)) return *e;
    out.push_back({std::get<ChunkKey>(key), arg.substr(eq + 1)});
  }
  return out;
}

std::variant<LayoutSpec::DType, UsageError> ParseDType(const std::string& text) {
  static const auto* kNames = new std::map<std::string, LayoutSpec::DType>{
      {"fp16", LayoutSpec::DType::kFloat16},       {"bf16", LayoutSpec::DType::kBFloat16},
      {"fp32", LayoutSpec::DType::kFloat32},       {"fp8e4m3", LayoutSpec::DType::kFloat8E4M3},
      {"fp8e5m2", LayoutSpec::DType::kFloat8E5M2},
  };
  auto it = kNames->find(absl::AsciiStrToLower(text));
  if (it == kNames->end()) {
    return UsageError{absl::StrCat(
        "--dtype must be one of fp16, bf16, fp32, fp8e4m3, fp8e5m2; got '", text, "'")};
  }
  return it->second;
}

// ---------------------------------------------------------------------------------
// Output helpers.

// "kvtier: COMMAND: CODE: message" on stderr. Returns kExitFailure.
int Fail(const std::string& command, const absl::Status& status) {
  std::cerr << "kvtier: " << command << ": " << absl::StatusCodeToString(status.code());
  if (!status.message().empty()) std::cerr << ": " << status.message();
  std::cerr << "\n";
  return kExitFailure;
}

// A text table with aligned columns, two spaces apart. `align` has one letter per
// column: 'l' left, 'r' right (numbers).
class Table {
 public:
  explicit Table(std::string align) : align_(std::move(align)) {}
  void AddRow(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  void Print(std::ostream& out) const {
    std::vector<size_t> widths;
    for (const auto& row : rows_) {
      widths.resize(std::max(widths.size(), row.size()), 0);
      for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
    }
    for (const auto& row : rows_) {
      std::string line;
      for (size_t c = 0; c < row.size(); ++c) {
        if (c > 0) line += "  ";
        const std::string pad(widths[c] - row[c].size(), ' ');
        const bool right = c < align_.size() && align_[c] == 'r';
        line += right ? pad + row[c] : row[c] + pad;
      }
      // Left-aligned last columns would leave trailing spaces.
      line.erase(line.find_last_not_of(' ') + 1);
      out << line << "\n";
    }
  }

 private:
  const std::string align_;
  std::vector<std::vector<std::string>> rows_;
};

std::string FormatUptime(uint64_t seconds) {
  const uint64_t d = seconds / 86400, h = seconds / 3600 % 24, m = seconds / 60 % 60,
                 s = seconds % 60;
  if (d > 0) return absl::StrFormat("%dd %02dh %02dm %02ds", d, h, m, s);
  if (h > 0) return absl::StrFormat("%dh %02dm %02ds", h, m, s);
  if (m > 0) return absl::StrFormat("%dm %02ds", m, s);
  return absl::StrFormat("%ds", s);
}

// ---------------------------------------------------------------------------------
// Commands. Each returns an exit status or a UsageError.

using Result = std::variant<int, UsageError>;

#define KVTIER_ASSIGN_OR_USAGE(lhs, expr)                          \
  auto lhs##_or = (expr);                                          \
  if (auto* e = std::get_if<UsageError>(&lhs##_or)) return *e;     \
  auto lhs = std::move(std::get<0>(lhs##_or))

absl::StatusOr<std::unique_ptr<KvTierClient>> ConnectFromArgs(const Args& args,
                                                              absl::Duration timeout) {
  ClientOptions options;
  options.rpc_deadline = timeout;
  options.tls_ca_file = args.Get("tls-ca").value_or("");
  options.tls_cert_file = args.Get("tls-cert").value_or("");
  options.tls_key_file = args.Get("tls-key").value_or("");
  options.tls_server_name = args.Get("tls-server-name").value_or("");
  if (std::optional<std::string> path = args.Get("token-file")) {
    std::ifstream in(*path);
    std::string token;
    if (!std::getline(in, token)) {
      return absl::InvalidArgumentError(absl::StrCat("--token-file: cannot read a line from ", *path));
    }
    options.bearer_token = std::string(absl::StripAsciiWhitespace(token));
  }
  return KvTierClient::Connect(args.Get("target").value_or(kDefaultTarget), options);
}

Result RunRegister(const Args& args, KvTierClient* client) {
  if (auto e = NoPositional(args)) return *e;
  LayoutSpec spec;
  KVTIER_ASSIGN_OR_USAGE(model_id, Required(args, "model-id"));
  KVTIER_ASSIGN_OR_USAGE(dtype_name, Required(args, "dtype"));
  KVTIER_ASSIGN_OR_USAGE(dtype, ParseDType(dtype_name));
  KVTIER_ASSIGN_OR_USAGE(layers, RequiredU32(args, "layers"));
  KVTIER_ASSIGN_OR_USAGE(kv_heads, RequiredU32(args, "kv-heads"));
  KVTIER_ASSIGN_OR_USAGE(head_dim, RequiredU32(args, "head-dim"));
  KVTIER_ASSIGN_OR_USAGE(tokens_per_chunk, RequiredU32(args, "tokens-per-chunk"));
  KVTIER_ASSIGN_OR_USAGE(tp_world_size, OptionalU32(args, "tp-world-size", 1));
  KVTIER_ASSIGN_OR_USAGE(tp_rank, OptionalU32(args, "tp-rank", 0));
  spec.model_id = model_id;
  spec.model_revision = args.Get("revision").value_or("");
  spec.dtype = dtype;
  spec.num_layers = layers;
  spec.num_kv_heads = kv_heads;
  spec.head_dim = head_dim;
  spec.tokens_per_chunk = tokens_per_chunk;
  spec.tp_world_size = tp_world_size;
  spec.tp_rank = tp_rank;
  spec.key_position = args.Has("pre-rope") ? LayoutSpec::KeyPosition::kPreRope
                                           : LayoutSpec::KeyPosition::kPostRope;
  // A bad combination of values (tp_rank >= tp_world_size, zero dimensions) is a usage
  // error: the message names the field.
  if (absl::Status s = spec.Validate(); !s.ok()) return UsageError{std::string(s.message())};

  if (client == nullptr) {  // --dry-run
    // Go through the wire message both ways, as the daemon will, so the dry run also
    // exercises the conversion.
    absl::StatusOr<LayoutSpec> round_trip = LayoutFromProto(LayoutToProto(spec));
    if (!round_trip.ok()) return Fail("register", round_trip.status());
    if (!(*round_trip == spec)) {
      return Fail("register", absl::InternalError("layout changed in proto round trip"));
    }
    std::cout << absl::StrFormat("namespace_id  %016x\nchunk_bytes   %u\n",
                                 round_trip->NamespaceId(), round_trip->ChunkBytes());
    return kExitOk;
  }
  absl::StatusOr<RegisterResult> r = client->RegisterLayout(spec);
  if (!r.ok()) return Fail("register", r.status());
  std::cout << absl::StrFormat(
      "namespace_id        %016x\nchunk_bytes         %u\nalready_registered  %s\n",
      r->namespace_id, r->chunk_bytes, r->already_registered ? "yes" : "no");
  return kExitOk;
}

Result RunKeys(const Args& args) {
  KVTIER_ASSIGN_OR_USAGE(ns, RequiredNamespace(args));
  KVTIER_ASSIGN_OR_USAGE(tokens_per_chunk, RequiredU32(args, "tokens-per-chunk"));
  KVTIER_ASSIGN_OR_USAGE(path, Required(args, "tokens-file"));
  if (tokens_per_chunk == 0) return UsageError{"--tokens-per-chunk must be >= 1"};
  if (auto e = NoPositional(args)) return *e;
  std::ifstream file;
  std::istream* in = &std::cin;
  if (path != "-") {
    file.open(path);
    if (!file) {
      return Fail("keys", absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path)));
    }
    in = &file;
  }
  const std::string name = path == "-" ? "stdin" : path;
  std::vector<uint32_t> tokens;
  std::string word;
  while (*in >> word) {
    uint32_t t = 0;
    if (!absl::c_all_of(word, absl::ascii_isdigit) || !absl::SimpleAtoi(word, &t)) {
      return Fail("keys", absl::InvalidArgumentError(absl::StrCat(
                              name, ": token ", tokens.size(), " ('", word,
                              "') is not an unsigned 32-bit integer")));
    }
    tokens.push_back(t);
  }
  if (in->bad()) {
    return Fail("keys", absl::DataLossError(absl::StrCat("error reading ", name)));
  }
  for (const ChunkKey& key : ComputeChunkKeys(ns, tokens, tokens_per_chunk)) {
    std::cout << key.ToHex() << "\n";
  }
  if (tokens.size() % tokens_per_chunk != 0) {
    std::cerr << absl::StrFormat("kvtier: keys: %u trailing tokens form no full chunk\n",
                                 tokens.size() % tokens_per_chunk);
  }
  return kExitOk;
}

Result RunPut(const Args& args, KvTierClient& client) {
  KVTIER_ASSIGN_OR_USAGE(ns, RequiredNamespace(args));
  KVTIER_ASSIGN_OR_USAGE(token_count, OptionalU32(args, "token-count", 0));
  KVTIER_ASSIGN_OR_USAGE(items, ParseKeyPaths(args, "FILE"));
  std::vector<std::unique_ptr<MappedFile>> files;
  std::vector<ChunkToPut> chunks;
  for (const KeyAndPath& item : items) {
    absl::StatusOr<std::unique_ptr<MappedFile>> file = MappedFile::Open(item.path);
    if (!file.ok()) return Fail("put", file.status());
    const uint64_t size = (*file)->data().size();
    if (size == 0) {
      return Fail("put", absl::InvalidArgumentError(absl::StrCat(item.path, ": file is empty")));
    }
    // Every chunk of a namespace has the same size; catch a mix-up before sending.
    if (!chunks.empty() && size != chunks.front().data.size()) {
      return Fail("put", absl::InvalidArgumentError(absl::StrCat(
                             item.path, " is ", size, " bytes but ", items.front().path,
                             " is ", chunks.front().data.size(),
                             "; every chunk of a namespace has the same size")));
    }
    chunks.push_back({item.key, (*file)->data(), token_count});
    files.push_back(*std::move(file));
  }
  ProgressMeter meter("put");
  absl::StatusOr<PutResult> r =
      client.Put(ns, chunks, [&](uint64_t done, uint64_t total) { meter.Update(done, total); });
  meter.Finish();
  if (!r.ok()) {
    Fail("put", r.status());
    if (r.status().code() == absl::StatusCode::kInvalidArgument) {
      std::cerr << absl::StrFormat(
          "kvtier: put: note: each FILE must hold exactly one chunk; these are %u bytes, "
          "compare with the chunk size `kvtier register` printed\n",
          chunks.front().data.size());
    }
    return kExitFailure;
  }
  std::cout << absl::StrFormat("put: %u chunks (%u stored, %u already present), %s\n",
                               chunks.size(), r->stored, r->already_present,
                               ProgressMeter::Summary(r->bytes, meter.Elapsed()));
  std::cout << "data path: " << client.data_path_detail() << "\n";
  return kExitOk;
}

// An output file of `get`: written to PATH.partial, renamed to PATH once the whole chunk
// arrived and checked out, removed otherwise. Never leaves a half-written PATH. A PATH
// that is a symlink is followed (the file it names is replaced, the link stays); one
// that is not a regular file (/dev/null, a FIFO), or is under /dev or /proc (/dev/stdout
// redirected to a file), is written in place, since renaming over it would replace the
// device or pipe with a file, or the redirected file with one chunk; what goes there is
// held in memory until the chunk checked out, so that a chunk cut short or failing its
// CRC32C leaves nothing of itself on stdout or in the pipe.
class PartialFile {
 public:
  explicit PartialFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".partial") {}
  PartialFile(const PartialFile&) = delete;
  PartialFile& operator=(const PartialFile&) = delete;
  ~PartialFile() { Abandon(); }

  // Whether `path` is written in place (several keys' chunks then follow one another
  // there) rather than replaced by a rename (where a later key's chunk replaces an
  // earlier one's).
  static bool WrittenInPlace(const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 &&  // Follows symlinks.
           (!S_ISREG(st.st_mode) || absl::StartsWith(path, "/dev/") ||
            absl::StartsWith(path, "/proc/"));
  }

  // The file a rename onto `path` replaces, resolved as Open resolves it when the chunk
  // lands: by then an earlier key's chunk may have created the target of a symlink that
  // dangles now, so links are followed whether their target exists or not.
  static std::string RenameTarget(const std::string& path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path p = path;
    for (int hops = 0; hops < 40 && fs::is_symlink(p, ec); ++hops) {  // ELOOP's bound.
      const fs::path to = fs::read_symlink(p, ec);
      if (ec) break;
      p = to.is_absolute() ? to : p.parent_path() / to;
    }
    const fs::path resolved = fs::weakly_canonical(p, ec);
    return ec ? path : resolved.string();
  }

  absl::Status Open() {
    // This process's own descriptors: written through a duplicate, so a redirection's
    // offset and O_APPEND hold (opening /proc/self/fd/1 anew would start at offset 0).
    int own_fd = -1;
    absl::string_view p = path_;
    if (p == "/dev/stdout") {
      own_fd = STDOUT_FILENO;
    } else if (p == "/dev/stderr") {
      own_fd = STDERR_FILENO;
    } else if ((absl::ConsumePrefix(&p, "/dev/fd/") || absl::ConsumePrefix(&p, "/proc/self/fd/")) &&
               !absl::SimpleAtoi(p, &own_fd)) {
      own_fd = -1;
    }
    if (own_fd >= 0) {
      in_place_ = true;
      tmp_ = path_;
      fd_ = ::fcntl(own_fd, F_DUPFD_CLOEXEC, 0);
      if (fd_ < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path_));
      return absl::OkStatus();
    }
    // /dev/stdout redirected to a file is a regular file behind /proc/self/fd: written
    // in place too, so that `>>` appends and several keys all arrive.
    if (WrittenInPlace(path_)) {
      in_place_ = true;
      tmp_ = path_;
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd_ < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path_));
      return absl::OkStatus();
    }
    if (char* real = ::realpath(path_.c_str(), nullptr); real != nullptr) {  // It exists.
      path_ = real;
      std::free(real);
      tmp_ = path_ + ".partial";
    }
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", tmp_));
    return absl::OkStatus();
  }
  absl::Status Write(absl::string_view data) {
    if (in_place_) {
      held_.append(data.data(), data.size());
      return absl::OkStatus();
    }
    return WriteAll(data);
  }
  absl::Status Commit() {
    if (in_place_) {
      absl::Status s = WriteAll(held_);
      held_.clear();
      if (!s.ok()) return s;
    }
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", tmp_));
    }
    if (in_place_) {
      committed_ = true;
      return absl::OkStatus();
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("cannot rename ", tmp_, " to ", path_));
    }
    committed_ = true;
    return absl::OkStatus();
  }

 private:
  absl::Status WriteAll(absl::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", tmp_));
      data.remove_prefix(static_cast<size_t>(n));
    }
    return absl::OkStatus();
  }
  void Abandon() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
    // ENOENT when never opened: fine. Never a path written in place.
    if (!committed_ && !in_place_) ::unlink(tmp_.c_str());
  }

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  bool in_place_ = false;  // Not a regular file: written directly, never renamed or removed.
  std::string held_;       // In place: the chunk's bytes until Commit.
  bool committed_ = false;
};

Result RunGet(const Args& args, KvTierClient& client) {
  KVTIER_ASSIGN_OR_USAGE(ns, RequiredNamespace(args));
  KVTIER_ASSIGN_OR_USAGE(items, ParseKeyPaths(args, "OUTFILE"));
  std::optional<LayerRange> layers;
  if (std::optional<std::string> text = args.Get("layers")) {
    std::vector<std::string> parts = absl::StrSplit(*text, ':');
    if (parts.size() != 2) return UsageError{"--layers must be B:E"};
    KVTIER_ASSIGN_OR_USAGE(begin, ParseU32("--layers begin", parts[0]));
    KVTIER_ASSIGN_OR_USAGE(end, ParseU32("--layers end", parts[1]));
    if (end <= begin) return UsageError{"--layers B:E needs B < E (E is exclusive)"};
    layers = LayerRange{begin, end};
  }
  // Two keys renamed onto one file would leave only the later chunk, reported as got:
  // refused before anything is fetched. Names of one file count as one (a symlink, "./").
  std::map<std::string, size_t> renamed_to;  // Resolved path -> first item writing it.
  for (size_t i = 0; i < items.size(); ++i) {
    if (PartialFile::WrittenInPlace(items[i].path)) continue;
    auto [first, inserted] = renamed_to.emplace(PartialFile::RenameTarget(items[i].path), i);
    if (!inserted) {
      return UsageError{absl::StrCat("OUTFILE ", items[i].path, " is also ",
                                     items[first->second].path, ", the OUTFILE of ",
                                     items[first->second].key.ToHex(),
                                     ": one file holds one chunk")};
    }
  }
  std::vector<ChunkKey> keys;
  for (const KeyAndPath& item : items) keys.push_back(item.key);

  ProgressMeter meter("get");
  // Files of keys answered so far (nullptr: not found, or not yet started).
  std::vector<std::unique_ptr<PartialFile>> files(items.size());
  std::vector<bool> found(items.size(), false);
  std::map<std::string, int> tiers;  // Tier name -> chunks read from it.
  int64_t current = -1;
  uint64_t done = 0, started = 0, known_total = 0, per_chunk = 0, got = 0;
  absl::Status status = client.GetStreamRaw(
      ns, keys, layers,
      [&](uint32_t index, const GetFrameHeader& frame,
          absl::Span<const absl::string_view> data) -> absl::Status {
        if (index != current) {  // First frame of this key.
          current = index;
          ++started;
          if (!frame.found()) return absl::OkStatus();
          found[index] = true;
          ++tiers[TierLabel(frame.tier())];
          known_total += frame.total_bytes();
          if (per_chunk == 0) per_chunk = frame.total_bytes();
          files[index] = std::make_unique<PartialFile>(items[index].path);
          if (absl::Status s = files[index]->Open(); !s.ok()) return s;
        }
        if (!found[index]) return absl::OkStatus();
        for (absl::string_view piece : data) {
          if (absl::Status s = files[index]->Write(piece); !s.ok()) return s;
          done += piece.size();
        }
        meter.Update(done, known_total + (keys.size() - started) * per_chunk);
        if (frame.last()) {
          ++got;
          absl::Status s = files[index]->Commit();
          files[index].reset();
          return s;
        }
        return absl::OkStatus();
      });
  meter.Finish();
  files.clear();  // Removes the partial file of a chunk cut short.
  if (!status.ok()) return Fail("get", status);
  int exit_code = kExitOk;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!found[i]) {
      std::cerr << "kvtier: get: " << items[i].key.ToHex() << ": not found ("
                << items[i].path << " not written)\n";
      exit_code = kExitFailure;
    }
  }
  std::string from;
  for (const auto& [name, n] : tiers) {
    absl::StrAppend(&from, from.empty() ? "" : ", ", name, " ", n);
  }
  // Chunks written to standard output keep it to themselves: the report goes to stderr.
  const bool chunks_on_stdout = std::any_of(items.begin(), items.end(), [](const auto& item) {
    return item.path == "/dev/stdout" || item.path == "/dev/fd/1" ||
           item.path == "/proc/self/fd/1";
  });
  std::ostream& report = chunks_on_stdout ? std::cerr : std::cout;
  report << absl::StrFormat("get: %u of %u chunks%s, %s\n", got, items.size(),
                            from.empty() ? "" : absl::StrCat(" (", from, ")"),
                            ProgressMeter::Summary(done, meter.Elapsed()));
  report << "data path: " << client.data_path_detail() << "\n";
  return exit_code;
}

Result RunLookup(const Args& args, KvTierClient& client) {
  KVTIER_ASSIGN_OR_USAGE(ns, RequiredNamespace(args));
  KVTIER_ASSIGN_OR_USAGE(keys, ParseKeys(args));
  absl::StatusOr<LookupResult> r = client.Lookup(ns, keys);
  if (!r.ok()) return Fail("lookup", r.status());
  Table table("rll");
  table.AddRow({"index", "key", "tier"});
  for (size_t i = 0; i < keys.size(); ++i) {
    table.AddRow({absl::StrCat(i), keys[i].ToHex(), TierLabel(r->tiers[i])});
  }
  table.Print(std::cout);
  std::cout << "prefix hits: " << r->prefix_hits << " of " << keys.size() << "\n";
  return kExitOk;
}

Result RunPin(const Args& args, KvTierClient& client) {
  KVTIER_ASSIGN_OR_USAGE(ns, RequiredNamespace(args));
  KVTIER_ASSIGN_OR_USAGE(ttl, OptionalU32(args, "ttl", 0));
  KVTIER_ASSIGN_OR_USAGE(keys, ParseKeys(args));
  absl::StatusOr<PinResult> r = client.Pin(ns, keys, ttl);
  if (!r.ok()) return Fail("pin", r.status());
  std::cout << absl::StrFormat("pinned %u, not found %u\n", r->pinned, r->not_found);
  return kExitOk;
}

Result RunUnpin(const Args& args, KvTierClient& client) {
  KVTIER_ASSIGN_OR_USAGE(ns, RequiredNamespace(args));
  KVTIER_ASSIGN_OR_USAGE(keys, ParseKeys(args));
  absl::StatusOr<uint32_t> r = client.Unpin(ns, keys);
  if (!r.ok()) return Fail("unpin", r.status());
  std::cout << absl::StrFormat("unpinned %u\n", *r);
  return kExitOk;
}

Result RunDelete(const Args& args, KvTierClient& client) {
  KVTIER_ASSIGN_OR_USAGE(ns, RequiredNamespace(args));
  KVTIER_ASSIGN_OR_USAGE(keys, ParseKeys(args));
  absl::StatusOr<uint32_t> r = client.Delete(ns, keys);
  if (!r.ok()) return Fail("delete", r.status());
  std::cout << absl::StrFormat("deleted %u\n", *r);
  return kExitOk;
}

Result RunClear(const Args& args, KvTierClient& client) {
  KVTIER_ASSIGN_OR_USAGE(ns, RequiredNamespace(args));
  if (auto e = NoPositional(args)) return *e;
  absl::StatusOr<uint64_t> r = client.Clear(ns);
  if (!r.ok()) return Fail("clear", r.status());
  std::cout << absl::StrFormat("removed %u chunks\n", *r);
  return kExitOk;
}

Result RunStats(const Args& args, KvTierClient& client) {
  if (auto e = NoPositional(args)) return *e;
  absl::StatusOr<v1::StatsResponse> r = client.Stats();
  if (!r.ok()) return Fail("stats", r.status());
  Table tiers("lrrrrrrrrr");
  tiers.AddRow({"tier", "capacity", "used", "used%", "payload", "pinned", "chunks", "hits",
                "misses", "evictions"});
  for (const v1::TierStats& t : r->tiers()) {
    const double used_pct =
        t.capacity_bytes() > 0 ? 100.0 * t.used_bytes() / t.capacity_bytes() : 0.0;
    tiers.AddRow({TierLabel(t.tier()), ProgressMeter::Bytes(t.capacity_bytes()),
                  ProgressMeter::Bytes(t.used_bytes()), absl::StrFormat("%.1f", used_pct),
                  ProgressMeter::Bytes(t.payload_bytes()), ProgressMeter::Bytes(t.pinned_bytes()), absl::StrCat(t.chunks()),
                  absl::StrCat(t.hits()), absl::StrCat(t.misses()),
                  absl::StrCat(t.evictions())});
  }
  tiers.Print(std::cout);
  std::cout << "\n";
  Table counters("ll");
  counters.AddRow({"namespaces", absl::StrCat(r->namespaces())});
  counters.AddRow({"promotions", absl::StrCat(r->promotions())});
  counters.AddRow({"demotions", absl::StrCat(r->demotions())});
  counters.AddRow({"checksum failures", absl::StrCat(r->checksum_failures())});
  counters.AddRow({"write-back queue", absl::StrCat(r->writeback_queue_depth())});
  counters.AddRow({"write mode", r->write_mode()});
  counters.AddRow({"uptime", FormatUptime(r->uptime_seconds())});
  counters.AddRow({"version", r->version()});
  counters.Print(std::cout);
  return kExitOk;
}

Result Run(const Args& args) {
  absl::Duration timeout = absl::Seconds(60);
  if (std::optional<std::string> text = args.Get("timeout")) {
    double seconds = 0;
    if (!absl::SimpleAtod(*text, &seconds) || !(seconds > 0)) {
      return UsageError{absl::StrCat("--timeout must be a positive number of seconds, got '",
                                     *text, "'")};
    }
    timeout = absl::Seconds(seconds);
  }
  if (std::optional<std::string> target = args.Get("target"); target && target->empty()) {
    return UsageError{"--target must not be empty"};
  }
  // Offline commands first: no connection needed.
  if (args.command == "keys") return RunKeys(args);
  if (args.command == "register" && args.Has("dry-run")) return RunRegister(args, nullptr);

  // Connect is lazy: an unreachable daemon shows up as UNAVAILABLE from the first RPC.
  absl::StatusOr<std::unique_ptr<KvTierClient>> client = ConnectFromArgs(args, timeout);
  if (!client.ok()) return Fail(args.command, client.status());
  KvTierClient& c = **client;
  if (args.command == "register") return RunRegister(args, &c);
  if (args.command == "put") return RunPut(args, c);
  if (args.command == "get") return RunGet(args, c);
  if (args.command == "lookup") return RunLookup(args, c);
  if (args.command == "pin") return RunPin(args, c);
  if (args.command == "unpin") return RunUnpin(args, c);
  if (args.command == "delete") return RunDelete(args, c);
  if (args.command == "clear") return RunClear(args, c);
  if (args.command == "stats") return RunStats(args, c);
  return UsageError{absl::StrCat("unknown command '", args.command, "'")};
}

#undef KVTIER_ASSIGN_OR_USAGE

int ReportUsageError(const Args* args, const UsageError& error) {
  std::cerr << "kvtier: ";
  if (args != nullptr && !args->command.empty() &&
      !absl::StartsWith(error.message, absl::StrCat(args->command, ":"))) {
    std::cerr << args->command << ": ";
  }
  std::cerr << error.message << "\nRun 'kvtier --help' for usage.\n";
  return kExitUsage;
}

// What a command wrote to stdout (a key list, a lookup, a chunk) is its result: one
// that did not all reach stdout (a full disk, a closed pipe) is a failure.
int CheckStdout(const char* command, int code) {
  std::cout.flush();
  if (std::cout.good()) return code;
  std::cerr << "kvtier: " << command << ": writing to standard output failed\n";
  return code == kExitOk ? kExitFailure : code;
}

int Main(int argc, char** argv) {
  std::variant<Args, UsageError> parsed = ParseArgs(argc, argv);
  if (auto* e = std::get_if<UsageError>(&parsed)) return ReportUsageError(nullptr, *e);
  const Args& args = std::get<Args>(parsed);
  if (args.help) {
    std::cout << kUsage;
    return CheckStdout("--help", kExitOk);
  }
  Result result = Run(args);
  if (auto* e = std::get_if<UsageError>(&result)) return ReportUsageError(&args, *e);
  return CheckStdout(args.command.c_str(), std::get<int>(result));
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) { return kvtier::Main(argc, argv); }
