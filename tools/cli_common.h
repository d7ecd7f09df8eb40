#pragma once
// Shared by the subcommands of the `conveyor` command line.
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "engine/schedule/generators.h"
#include "engine/schedule/input_file.h"
#include "layers/model.h"

namespace conveyor::cli {

// Bad flags, impossible configurations, malformed input files: printed as one line
// "conveyor: error: <message>" and the process exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "a", "a and b", "a, b and c": items as a sentence lists them.
inline std::string listed(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i)
    out += (i == 0 ? "" : i + 1 == items.size() ? " and " : ", ") + items[i];
  return out;
}

// A flag that takes one of a few words or forms, refused naming the flag, what it takes and
// the value seen, escaped: a line break typed into the value stays on the error's one line.
inline UsageError not_one_of(const std::string& flag, const std::string& accepted,
                             const std::string& value) {
  return UsageError(flag + " must be " + accepted + ", got '" + escaped_for_message(value) + "'");
}

// --optimizer takes the kinds the library's optimizer does; refused here to name the flag.
inline void check_optimizer_flag(const std::string& kind) {
  if (kind != "adamw" && kind != "sgd") throw not_one_of("--optimizer", "adamw or sgd", kind);
}

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
// A command stopped by a signal ends with 128 + the signal, as a shell shows a process the
// signal killed: 130 SIGINT, 143 SIGTERM, 129 SIGHUP, 138 SIGUSR1, 141 SIGPIPE, 152 SIGXCPU.
inline constexpr int kExitInterrupted = 128;

// An error that every process of a launch of several meets alike, ending each with `status`:
// a refusal (kExitUsage: the ranks' checks against each other, a launcher this build cannot
// run under) or a failure (kExitFailure: a step whose all-reduced loss is not finite). Only
// the launch's first process prints it, the others end silently (error_line.h).
class ErrorOfEveryProcess : public std::runtime_error {
 public:
  ErrorOfEveryProcess(const std::string& message, int status)
      : std::runtime_error(message), status_(status) {}
  int status() const { return status_; }

 private:
  int status_;
};

// The statuses of a command a stop signal ended, as every help text lists them.
inline constexpr const char* kInterruptedStatusText =
    "130/143/129/138/141/152 interrupted (SIGINT/SIGTERM/SIGHUP/SIGUSR1/SIGPIPE/SIGXCPU)";
// The exit status convention, as help texts show it; `failure` says what status 1 means for
// the command showing it.
inline std::string exit_status_text(const std::string& failure) {
  return "Exit status: 0 ok, 1 " + failure + ", 2 bad input, " + kInterruptedStatusText + ".";
}
inline const std::string kExitStatusText = exit_status_text(
    "training failed or diverged, a checkpoint could not be saved (under --on-save-error "
    "continue: that of the run's last step), or an output file or stdout could not be written");

// Thrown after a command has said everything it had to say, to end with `code` (an
// interrupted run: kExitInterrupted + the signal).
struct ExitRequest {
  int code;
};

// Every schedule kind, as help texts list them: "gpipe, 1f1b, interleaved, zbh1 or zbv".
// Read from the schedule module's own list, so a new kind shows up here by itself.
inline std::string schedule_choices_text() {
  const auto kinds = schedule::schedule_kinds();
  std::string out;
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (i > 0) out += i + 1 == kinds.size() ? " or " : ", ";
    out += kinds[i].name;
  }
  return out;
}

// A --chunks that the schedule kind never takes (schedule::takes_chunks), refused in the
// flag's words where the generator speaks of chunks per rank.
inline void check_chunks_flag(schedule::ScheduleKind kind, int chunks) {
  if (schedule::takes_chunks(kind, chunks)) return;
  if (kind == schedule::ScheduleKind::kZBV)
    throw UsageError("zbv always has 2 chunks per rank in a V; --chunks " + std::to_string(chunks) +
                     " does not apply (leave it out or use 2)");
  throw UsageError(std::string(schedule::schedule_kind_name(kind)) +
                   " has one chunk per rank; --chunks " + std::to_string(chunks) +
                   " is only for 'interleaved' (leave it out)");
}

// A number as people read it: 1e-09, 0.25, 4096 (printf's %g with 6 digits).
inline std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Plain decimal digits, the one way a count is written on the command line: no sign, space,
// 0x or exponent, and leading zeros do not mean octal. nullopt for anything else; digits past
// UINT64_MAX give UINT64_MAX, which each caller's own bound refuses. Every integer and size
// flag reads its digits here: add_int_flag, --partition's block counts, --recompute's units
// and --memory-cap.
inline std::optional<uint64_t> parse_decimal_digits(std::string_view text) {
  if (text.empty()) return std::nullopt;
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  uint64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const auto digit = static_cast<uint64_t>(c - '0');
    value = value > (kMax - digit) / 10 ? kMax : value * 10 + digit;
  }
  return value;
}

// A whole number in plain decimal (parse_decimal_digits), within [lo, hi]. A minus sign is
// read only to say that a negative value is below the range; `+1` and `-0` are refused.
// Throws UsageError naming the flag, the accepted range and the value seen.
inline int64_t parse_int(std::string_view text, std::string_view flag, int64_t lo, int64_t hi) {
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  auto fail = [&](const std::string& why) -> int64_t {
    throw UsageError(std::string(flag) + " expects a whole number in " + range + ", got '" +
                     escaped_for_message(text) + "'" + why);
  };
  const bool negative = !text.empty() && text[0] == '-';
  const std::optional<uint64_t> magnitude = parse_decimal_digits(text.substr(negative ? 1 : 0));
  if (!magnitude) return fail(text.empty() ? "" : " (base-10 digits only)");
  if (negative && *magnitude == 0) return fail(" (base-10 digits only)");
  // 2^63: the magnitude of INT64_MIN, the largest a negative value has.
  constexpr uint64_t kNegativeLimit = uint64_t{1} << 63;
  if (*magnitude > (negative ? kNegativeLimit : kNegativeLimit - 1)) return fail(" (out of range)");
  const int64_t value =
      negative ? static_cast<int64_t>(0 - *magnitude) : static_cast<int64_t>(*magnitude);
  if (value < lo)
    throw UsageError(std::string(flag) + " must be at least " + std::to_string(lo) + ", got '" +
                     escaped_for_message(text) + "' (a whole number in " + range + ")");
  if (value > hi) return fail(" (out of range)");
  return value;
}

// A finite number in [lo, hi]; `lo_open` excludes lo itself (rates and timeouts that must be
// positive). Plain decimal only (an optional sign, digits, a point, an exponent): no spaces
// around it, no hex, which strtod would take. nan and inf are refused by name. A value too
// small for a double stays a positive (or negative) number, the smallest there is, so a
// check for "too small" sees it rather than 0.
inline double parse_float(std::string_view text, std::string_view flag, double lo, double hi,
                          bool lo_open = false) {
  const std::string range =
      std::string(lo_open ? "(" : "[") + format_number(lo) + ", " + format_number(hi) + "]";
  auto fail = [&]() -> double {
    throw UsageError(std::string(flag) + " expects a finite number in " + range + ", got '" +
                     escaped_for_message(text) + "'");
  };
  std::string_view digits = text;
  // from_chars takes '-' but not '+'; "+-5" stays refused.
  if (!digits.empty() && digits[0] == '+') {
    digits.remove_prefix(1);
    if (!digits.empty() && digits[0] == '-') return fail();
  }
  if (digits.empty()) return fail();
  double v = 0.0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (end != digits.data() + digits.size() || ec == std::errc::invalid_argument) return fail();
  if (ec == std::errc::result_out_of_range) {
    // Well-formed but beyond a double: strtod says which way (HUGE_VAL, or 0 on underflow).
    const double rough = std::strtod(std::string(digits).c_str(), nullptr);
    if (!(std::fabs(rough) < 1.0)) return fail();
    v = std::copysign(std::numeric_limits<double>::denorm_min(), digits[0] == '-' ? -1.0 : 1.0);
  }
  if (!std::isfinite(v) || v < lo || v > hi || (lo_open && v == lo)) return fail();
  // "-0" is 0, within a range from 0; its sign would be shown back as a negative value
  // (costs F=-0, --clip -0 inherited on resume).
  return v == 0.0 ? 0.0 : v;
}

// The smallest magnitude other than 0 that a floating-point flag takes. Under it a number
// underflows a double (1e-400, read by parse_float as the smallest double there is) or loses
// its precision (1e-310, a subnormal), and sums and products of it vanish without a word.
inline constexpr double kSmallestFlagNumber = 1e-300;

// `v`, read by parse_float from `text`, unless it is a number other than 0 under
// kSmallestFlagNumber: UsageError naming the flag and the text given (its double would show
// a value never typed). `zero_ok`: whether 0 is offered instead. Flags with a floor of their
// own (--bucket-mb's 1 KiB) say theirs instead.
inline double refuse_vanishing(double v, std::string_view text, std::string_view flag,
                               bool zero_ok) {
  if (v == 0.0 || std::fabs(v) >= kSmallestFlagNumber) return v;
  throw UsageError(std::string(flag) + " '" + escaped_for_message(text) +
                   "' is too small to compute with; give " + (zero_ok ? "0 or " : "") +
                   "a number of at least " + format_number(kSmallestFlagNumber));
}

}  // namespace conveyor::cli
