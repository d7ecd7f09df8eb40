#include "engine/schedule/text_format.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <vector>

#include "engine/schedule/generators.h"
#include "engine/schedule/input_file.h"

namespace conveyor::schedule {
namespace {

constexpr std::string_view kHeader = "# conveyor schedule:";
// The CSV form's column line, which its writer prints and its reader requires.
constexpr std::string_view kCsvColumns = "rank,step,kind,stage,microbatch,peer";

std::string header_line(const Schedule& s) {
  std::string out(kHeader);
  if (!s.name.empty()) out += " name=" + s.name;
  out += " ranks=" + std::to_string(s.placement.num_ranks);
  out += " chunks=" + std::to_string(s.placement.chunks);
  out += std::string(" layout=") + layout_name(s.placement.layout);
  out += " microbatches=" + std::to_string(s.num_microbatches);
  // Only data-parallel schedules say it, so single-pipeline files stay as they were.
  if (s.replicas != 1) out += " replicas=" + std::to_string(s.replicas);
  out += "\n";
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// What follows "# conveyor schedule:" when `line` is the header, typed as dump_text writes it
// or by hand with other blanks ("#conveyor schedule:", tabs); nullopt for any other line.
std::optional<std::string_view> header_entries(std::string_view line) {
  const auto blank = [](char c) { return c == ' ' || c == '\t'; };
  const auto skip_blanks = [&](std::string_view s) {
    while (!s.empty() && blank(s.front())) s.remove_prefix(1);
    return s;
  };
  if (!line.starts_with('#')) return std::nullopt;
  std::string_view rest = skip_blanks(line.substr(1));
  if (!rest.starts_with("conveyor")) return std::nullopt;
  rest.remove_prefix(std::string_view("conveyor").size());
  if (rest.empty() || !blank(rest.front())) return std::nullopt;
  rest = skip_blanks(rest);
  if (!rest.starts_with("schedule:")) return std::nullopt;
  return rest.substr(std::string_view("schedule:").size());
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i)
    if (i == s.size() || s[i] == sep) {
      out.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  return out;
}

std::vector<std::string_view> lines_of(std::string_view text) { return split(text, '\n'); }

// "line N <what>", for what is wrong with the line as a whole.
ScheduleError line_error_at(int line, const std::string& what) {
  return ScheduleError("line " + std::to_string(line) + " " + what);
}

ScheduleError line_error(int line, const std::string& what) {
  return ScheduleError("line " + std::to_string(line) + ": " + what);
}

// A non-negative integer of at most `max`.
int to_int(std::string_view v, int line, const std::string& field,
           int max = std::numeric_limits<int>::max()) {
  int out = 0;
  v = trim(v);
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  const bool digits = !v.empty() && ptr == v.data() + v.size() && v.front() != '-';
  // Digits past the range are a number, only too large: said so, not "not an integer".
  if (digits && (ec == std::errc::result_out_of_range || (ec == std::errc() && out > max)))
    throw line_error(line, field + " " + message_excerpt(v) + " is larger than supported (" +
                               std::to_string(max) + ")");
  if (!digits || ec != std::errc() || out < 0)
    throw line_error(line,
                     field + " must be a non-negative integer, got '" + message_excerpt(v) + "'");
  return out;
}

int to_rank(std::string_view v, int line) { return to_int(v, line, "rank", kMaxFileRank); }

// Header values; -1 means "not given, infer".
struct Header {
  std::string name;
  int ranks = -1, chunks = -1, microbatches = -1, replicas = -1;
  Layout layout = Layout::kLooped;
  std::map<std::string, std::string> given;  // key -> value, over every header line
};

void parse_header(std::string_view entries, int line_no, Header* h) {
  std::istringstream in{std::string(entries)};
  std::string kv;
  while (in >> kv) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos)
      throw line_error(line_no, "header entry '" + message_excerpt(kv) + "' is not key=value");
    const std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
    if (value.empty())
      throw line_error(line_no, "header entry '" + message_excerpt(kv) +
                                    "' has no value; give one or leave " +
                                    (key.empty() ? "it" : message_excerpt(key)) + " out");
    // A later value would replace the first without a word: a file edited by hand.
    if (const auto [at, added] = h->given.emplace(key, value); !added)
      throw line_error(line_no, "header entry '" + message_excerpt(key) + "' is given twice (" +
                                    message_excerpt(key + "=" + at->second) + ", then " +
                                    message_excerpt(kv) + "); give it once");
    if (key == "name")
      h->name = value;
    else if (key == "ranks")
      h->ranks = to_int(value, line_no, "ranks", 65536);
    else if (key == "chunks")
      h->chunks = to_int(value, line_no, "chunks", 65536);
    else if (key == "microbatches")
      h->microbatches = to_int(value, line_no, "microbatches", 1048576);
    else if (key == "replicas")
      h->replicas = to_int(value, line_no, "replicas", 65536);
    else if (key == "layout") {
      if (value == "looped")
        h->layout = Layout::kLooped;
      else if (value == "v")
        h->layout = Layout::kVShape;
      else
        throw line_error(line_no,
                         "layout must be 'looped' or 'v', got '" + message_excerpt(value) + "'");
    } else {
      throw line_error(line_no, "unknown header key '" + message_excerpt(key) +
                                    "' (expected name, ranks, chunks, layout, microbatches, "
                                    "replicas)");
    }
  }
}

// A name is a label an edited file keeps, but a generated kind's name also says the shape its
// readers rely on (a checkpoint records it, the planner's advice generates the kind again at
// other sizes): chunks per rank, a V for zbv's two chunks, and a backward split into I and W
// for the zero-bubble kinds. A file that cannot have it is refused rather than run under it.
void check_name_fits_shape(const Schedule& s) {
  const std::optional<ScheduleKind> kind = parse_schedule_kind(s.name);
  if (!kind) return;
  const int chunks = s.placement.chunks;
  const std::string tail =
      "; a file named after a kind has its shape, so give this one another name or none";
  const std::string named = "the header's name=" + s.name + " is a kind ";
  if (!takes_chunks(*kind, chunks) || chunks_per_rank(*kind, chunks) != chunks) {
    const int wants = chunks_per_rank(*kind, 1);
    throw ScheduleError(named + "of " + std::to_string(wants) + " chunk" + (wants == 1 ? "" : "s") +
                        " per rank, but the file has " + std::to_string(chunks) + tail);
  }
  const Layout layout = *kind == ScheduleKind::kZBV ? Layout::kVShape : Layout::kLooped;
  // With one chunk per rank both layouts place stage r on rank r.
  if (chunks > 1 && s.placement.layout != layout)
    throw ScheduleError(named + "laid out " +
                        (layout == Layout::kVShape ? "in a V" : layout_name(layout)) +
                        " (layout=" + layout_name(layout) +
                        "), but the file has layout=" + layout_name(s.placement.layout) + tail);
  if (*kind != ScheduleKind::kZBH1 && *kind != ScheduleKind::kZBV) return;
  for (const auto& list : s.ranks)
    for (const Action& a : list)
      if (a.kind == ActionKind::kBackwardInput || a.kind == ActionKind::kBackwardWeight) return;
  throw ScheduleError(named +
                      "whose backward is split into I and W, but the file has no I or W "
                      "action" +
                      tail);
}

Schedule finish(const Header& h, std::vector<std::vector<Action>> ranks) {
  // An all-reduce's second number is its bucket, not a micro-batch: it says nothing of how many
  // micro-batches there are.
  int max_stage = -1, max_mb = -1, max_bucket = -1;
  for (const auto& list : ranks)
    for (const auto& a : list) {
      max_stage = std::max(max_stage, a.stage);
      int& max_index = is_reduce(a.kind) ? max_bucket : max_mb;
      max_index = std::max(max_index, a.microbatch);
    }
  if (h.ranks > 65536 || h.chunks > 65536 || h.microbatches > 1048576 || h.replicas > 65536 ||
      static_cast<long long>(std::max(h.ranks, 1)) * std::max(h.chunks, 1) > 65536)
    throw ScheduleError(
        "the header asks for more than 65536 stages or replicas, or 1048576 micro-batches");
  // The same limits for the stages and micro-batches the actions name, from which the counts
  // the header leaves out are inferred.
  if (max_stage >= 65536)
    throw ScheduleError("an action names stage " + std::to_string(max_stage) +
                        "; at most 65536 stages (0 to 65535) are supported");
  if (max_mb >= 1048576)
    throw ScheduleError("an action names micro-batch " + std::to_string(max_mb) +
                        "; at most 1048576 micro-batches (0 to 1048575) are supported");
  if (max_bucket >= 1048576)
    throw ScheduleError("an action names all-reduce bucket " + std::to_string(max_bucket) +
                        "; at most 1048576 buckets (0 to 1048575) are supported");
  Schedule s;
  s.name = h.name;
  s.placement.num_ranks = h.ranks >= 0 ? h.ranks : static_cast<int>(ranks.size());
  if (s.placement.num_ranks < 1)
    throw ScheduleError("the schedule has no ranks (expected lines 'r0: ...')");
  if (static_cast<int>(ranks.size()) > s.placement.num_ranks)
    throw ScheduleError("the schedule has a line for rank " + std::to_string(ranks.size() - 1) +
                        " but the header says ranks=" + std::to_string(s.placement.num_ranks));
  // Every rank owns a stage, so it has actions: a rank without any is a line left out, which
  // the validator would report as another rank's transfer to it missing.
  ranks.resize(s.placement.num_ranks);
  for (size_t r = 0; r < ranks.size(); ++r)
    if (ranks[r].empty())
      throw ScheduleError("rank " + std::to_string(r) + " of " +
                          std::to_string(s.placement.num_ranks) +
                          " has no actions (expected a line 'r" + std::to_string(r) +
                          ": F...' or its CSV rows; every rank runs the forwards and backwards "
                          "of its stages)");
  const int inferred_chunks =
      std::max(1, (max_stage + s.placement.num_ranks) / s.placement.num_ranks);
  s.placement.chunks = h.chunks >= 0 ? h.chunks : inferred_chunks;
  if (s.placement.chunks < 1) throw ScheduleError("chunks must be at least 1");
  // Every stage runs its forwards and backwards: stages no action names are a header that
  // counts more chunks than the actions use, which the validator would report as a transfer
  // to the first of them missing.
  const long long stages = static_cast<long long>(s.placement.num_ranks) * s.placement.chunks;
  if (max_stage + 1 < stages)
    throw ScheduleError(
        "the header's chunks=" + std::to_string(s.placement.chunks) + " makes " +
        std::to_string(stages) + " stages (" + std::to_string(s.placement.num_ranks) + " ranks x " +
        std::to_string(s.placement.chunks) + " chunks), but the actions name " +
        (max_stage < 0 ? std::string("no stage")
                       : "stages 0 to " + std::to_string(max_stage) + " only") +
        "; every stage runs its forwards and backwards (chunks=" + std::to_string(inferred_chunks) +
        " fits these actions)");
  s.placement.layout = h.layout;
  s.num_microbatches = h.microbatches >= 0 ? h.microbatches : std::max(1, max_mb + 1);
  if (s.num_microbatches < 1) throw ScheduleError("microbatches must be at least 1");
  s.replicas = h.replicas >= 0 ? h.replicas : 1;
  if (s.replicas < 1) throw ScheduleError("replicas must be at least 1");
  s.ranks = std::move(ranks);
  check_name_fits_shape(s);
  return s;
}

// Bytes no line of a schedule holds, said before they are misread: UTF-16 (PowerShell's '>',
// Notepad's "Unicode"), a NUL byte, which would also end any message quoting it, and line
// ends of a lone carriage return (classic Mac OS), which make the file one comment line.
void refuse_what_is_not_text(std::string_view text) {
  for (const std::string_view mark : {std::string_view("\xFF\xFE"), std::string_view("\xFE\xFF")})
    if (text.starts_with(mark))
      throw ScheduleError(std::string("the file is UTF-16 (it starts with the byte-order mark ") +
                          (mark[0] == '\xFF' ? "FF FE" : "FE FF") +
                          "); save it as UTF-8 or ASCII text");
  int line = 1;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n') ++line;
    if (text[i] == '\0')
      throw line_error_at(line, "holds a NUL byte; a schedule file is text (UTF-8 or ASCII)");
    // CRLF, and the CRs of a CRCRLF some tools write, end a line; a CR followed by more of it
    // does not.
    size_t next = i;
    while (next < text.size() && text[next] == '\r') ++next;
    if (next > i && next < text.size() && text[next] != '\n')
      throw line_error_at(line,
                          "ends in a carriage return without a line feed (classic Mac OS line "
                          "ends); save the file with LF or CRLF line ends");
    if (next > i) i = next - 1;
  }
}

void put(std::vector<std::vector<Action>>* ranks, int rank, int line, Action a) {
  if (static_cast<int>(ranks->size()) <= rank) ranks->resize(rank + 1);
  (*ranks)[rank].push_back(a);
}

}  // namespace

std::string dump_text(const Schedule& s) {
  std::string out = header_line(s);
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    out.append("r").append(std::to_string(r)).append(":");
    for (const auto& a : s.ranks[r]) out.append(" ").append(to_string(a));
    out += "\n";
  }
  return out;
}

std::string dump_csv(const Schedule& s) {
  std::string out = header_line(s);
  out.append(kCsvColumns).append("\n");
  for (size_t r = 0; r < s.ranks.size(); ++r)
    for (size_t i = 0; i < s.ranks[r].size(); ++i) {
      const auto& a = s.ranks[r][i];
      out += std::to_string(r) + "," + std::to_string(i) + "," + kind_name(a.kind) + "," +
             std::to_string(a.stage) + "," +
             (is_reduce(a.kind) && a.microbatch == 0 ? "" : std::to_string(a.microbatch)) + "," +
             (is_transfer(a.kind) ? std::to_string(a.peer) : "") + "\n";
    }
  return out;
}

Schedule parse_text(std::string_view text) {
  Header h;
  std::vector<std::vector<Action>> ranks;
  std::vector<bool> seen;
  int line_no = 0;
  for (auto raw : lines_of(text)) {
    ++line_no;
    auto line = trim(raw);
    if (line.empty()) continue;
    if (const auto entries = header_entries(line)) {
      parse_header(*entries, line_no, &h);
      continue;
    }
    if (line.front() == '#') continue;
    // A '#' after the actions starts a comment, as on a line of its own: no action holds one.
    line = trim(line.substr(0, line.find('#')));
    const auto colon = line.find(':');
    if (line.front() != 'r' || colon == std::string_view::npos)
      throw line_error(
          line_no, "expected 'r<rank>: <actions>', got '" + std::string(line.substr(0, 40)) + "'");
    const int rank = to_rank(line.substr(1, colon - 1), line_no);
    if (rank < static_cast<int>(seen.size()) && seen[rank])
      throw line_error(line_no, "rank " + std::to_string(rank) + " appears twice");
    if (static_cast<int>(seen.size()) <= rank) seen.resize(rank + 1);
    seen[rank] = true;
    if (static_cast<int>(ranks.size()) <= rank) ranks.resize(rank + 1);
    std::istringstream tokens{std::string(line.substr(colon + 1))};
    std::string token;
    while (tokens >> token) {
      try {
        put(&ranks, rank, line_no, parse_action(token));
      } catch (const ScheduleError& e) {
        throw line_error(line_no, e.what());
      }
    }
  }
  return finish(h, std::move(ranks));
}

Schedule parse_csv(std::string_view text) {
  Header h;
  std::vector<std::vector<Action>> ranks;
  std::vector<int> next_step;
  int line_no = 0;
  bool saw_columns = false;
  for (auto raw : lines_of(text)) {
    ++line_no;
    auto line = trim(raw);
    if (line.empty()) continue;
    if (const auto entries = header_entries(line)) {
      parse_header(*entries, line_no, &h);
      continue;
    }
    if (line.front() == '#') continue;
    // A spreadsheet would read a comment after a row as a cell of its own.
    if (line.find('#') != std::string_view::npos)
      throw line_error(line_no,
                       "a comment in a CSV file takes a whole line starting with '#', "
                       "got '" +
                           message_excerpt(line) + "'");
    if (!saw_columns) {
      if (line != kCsvColumns)
        throw line_error(line_no, "expected the column line '" + std::string(kCsvColumns) +
                                      "', got '" + std::string(line.substr(0, 60)) + "'");
      saw_columns = true;
      continue;
    }
    const auto f = split(line, ',');
    if (f.size() != 6)
      throw line_error(line_no,
                       "expected 6 comma-separated fields, got " + std::to_string(f.size()));
    const int rank = to_rank(f[0], line_no);
    const int step = to_int(f[1], line_no, "step");
    if (static_cast<int>(next_step.size()) <= rank) next_step.resize(rank + 1, 0);
    if (step != next_step[rank])
      throw line_error(line_no, "rank " + std::to_string(rank) + " expected step " +
                                    std::to_string(next_step[rank]) + ", got " +
                                    std::to_string(step) +
                                    " (rows of a rank must be in step order)");
    ++next_step[rank];
    Action a;
    const auto kind = trim(f[2]);
    bool known = false;
    for (int k = 0; k <= static_cast<int>(ActionKind::kAllReduceGrad); ++k)
      if (kind == kind_name(static_cast<ActionKind>(k)))
        a.kind = static_cast<ActionKind>(k), known = true;
    if (!known)
      throw line_error(line_no,
                       "unknown kind '" + message_excerpt(kind) +
                           "' (expected F, B, I, W, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, "
                           "ALLREDUCE_GRAD)");
    a.stage = to_int(f[3], line_no, "stage", kMaxFileStage);
    // An ALLREDUCE_GRAD covers every micro-batch: the column holds its bucket, empty for 0.
    if (!is_reduce(a.kind) || !trim(f[4]).empty())
      a.microbatch =
          to_int(f[4], line_no, is_reduce(a.kind) ? "bucket" : "microbatch", kMaxFileMicrobatch);
    if (is_transfer(a.kind))
      a.peer = to_int(f[5], line_no, "peer", kMaxFileRank);
    else if (!trim(f[5]).empty())
      throw line_error(line_no, "a compute or all-reduce action has no peer");
    put(&ranks, rank, line_no, a);
  }
  return finish(h, std::move(ranks));
}

Schedule parse_schedule(std::string_view text) {
  refuse_what_is_not_text(text);
  // Editors on Windows (Notepad, Excel's "CSV UTF-8") start a UTF-8 file with a byte-order mark.
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);
  int line_no = 0;
  for (auto raw : lines_of(text)) {
    ++line_no;
    auto line = trim(raw);
    if (line.empty() || line.front() == '#') continue;
    // A text line starts r<rank>; a line of commas that does not (a column line a spreadsheet
    // recased or spaced) is CSV, so that the error names the column line expected.
    const bool text_line = line.size() > 1 && line[0] == 'r' && line[1] >= '0' && line[1] <= '9';
    const bool csv =
        line.substr(0, 5) == "rank," || (!text_line && line.find(',') != std::string_view::npos);
    // Spreadsheets in locales with a decimal comma save CSV with ';' between the fields.
    if (!csv && !text_line && line.find(';') != std::string_view::npos)
      throw line_error(line_no,
                       "the fields are separated by ';', and a schedule's CSV separates "
                       "them by ',' (" +
                           std::string(kCsvColumns) + "); got '" + message_excerpt(line) + "'");
    return csv ? parse_csv(text) : parse_text(text);
  }
  throw ScheduleError("the schedule is empty (expected lines 'r0: F0.0 ...' or CSV rows)");
}

void save_schedule(const std::string& path, const Schedule& schedule) {
  const bool csv = path.size() >= 4 && path.substr(path.size() - 4) == ".csv";
  std::ofstream out(path);
  if (!out) throw ScheduleError("cannot open " + quoted_file_name(path) + " for writing");
  out << (csv ? dump_csv(schedule) : dump_text(schedule));
  // Buffered bytes fail only when flushed (a full disk, /dev/full): check the close too.
  out.close();
  if (out.fail())
    throw ScheduleError("cannot write " + quoted_file_name(path) + " (disk full or write error)");
}

Schedule load_schedule(const std::string& path) {
  std::string text;
  try {
    text = read_input_file(path, {"schedule file " + quoted_file_name(path),
                                  "a text or CSV file written by save_schedule",
                                  kMaxScheduleFileBytes, "are accepted"});
  } catch (const InputFileError& e) {
    throw ScheduleError(e.what());
  }
  try {
    return parse_schedule(text);
  } catch (const ScheduleError& e) {
    throw ScheduleError("schedule file " + quoted_file_name(path) + ": " + e.what());
  }
}

}  // namespace conveyor::schedule
