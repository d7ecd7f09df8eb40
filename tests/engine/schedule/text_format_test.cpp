// Dump and load: every generated schedule round-trips unchanged through text and CSV.
#include "engine/schedule/text_format.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "engine/schedule/generators.h"
#include "engine/schedule/validator.h"

namespace conveyor::schedule {
namespace {

std::vector<Schedule> sample_schedules() {
  std::vector<Schedule> out;
  for (int p : {1, 2, 3, 4, 7})
    for (int m : {1, 2, 5, 8, 12}) {
      out.push_back(generate_gpipe(p, m));
      out.push_back(generate_1f1b(p, m));
      out.push_back(generate_zbh1(p, m));
      out.push_back(generate_zbv(p, m));
      if (m % p == 0)
        for (int v : {2, 3}) out.push_back(generate_interleaved(p, m, v));
      // interleaved at v=1 is 1F1B under its own name; data parallelism adds all-reduces.
      out.push_back(generate(ScheduleKind::kInterleaved, p, m, 1));
      out.push_back(generate(ScheduleKind::kZBV, p, m, 1, 2));
      out.push_back(generate(ScheduleKind::kZBH1, p, m, 1, 3));
    }
  return out;
}

TEST(TextFormat, ActionTokensRoundTrip) {
  for (auto kind : {ActionKind::kForward, ActionKind::kBackward, ActionKind::kBackwardInput,
                    ActionKind::kBackwardWeight, ActionKind::kSendAct, ActionKind::kRecvAct,
                    ActionKind::kSendGrad, ActionKind::kRecvGrad}) {
    const Action a{kind, 12, 345, is_transfer(kind) ? 7 : -1};
    EXPECT_EQ(parse_action(to_string(a)), a) << to_string(a);
  }
  EXPECT_EQ(to_string(forward(0, 3)), "F0.3");
  EXPECT_EQ(to_string(Action{ActionKind::kSendAct, 0, 3, 1}), "SA0.3>1");
  EXPECT_EQ(to_string(Action{ActionKind::kRecvGrad, 0, 3, 1}), "RG0.3<1");
}

TEST(TextFormat, MalformedTokensAreRejected) {
  for (const char* bad :
       {"X0.1", "F0", "F.1", "F0.", "F-1.0", "SA0.1", "SA0.1>", "RA1.0>0", "F0.1x", "B0.1.2"})
    EXPECT_THROW(parse_action(bad), ScheduleError) << bad;
}

TEST(TextFormat, EveryGeneratedScheduleRoundTrips) {
  for (const Schedule& s : sample_schedules()) {
    const Schedule from_text = parse_text(dump_text(s));
    EXPECT_EQ(from_text, s) << s.name << "\n" << dump_text(s);
    EXPECT_EQ(from_text.name, s.name);
    EXPECT_EQ(dump_text(from_text), dump_text(s));
    const Schedule from_csv = parse_csv(dump_csv(s));
    EXPECT_EQ(from_csv, s) << s.name;
    EXPECT_EQ(parse_schedule(dump_csv(s)), s);
    EXPECT_EQ(parse_schedule(dump_text(s)), s);
  }
}

TEST(TextFormat, FilesRoundTrip) {
  const auto dir = std::filesystem::temp_directory_path();
  const Schedule s = generate_interleaved(2, 4, 2);
  for (const char* name : {"conveyor_sched_test.txt", "conveyor_sched_test.csv"}) {
    const std::string path = (dir / name).string();
    save_schedule(path, s);
    EXPECT_EQ(load_schedule(path), s) << path;
    std::remove(path.c_str());
  }
  EXPECT_THROW(load_schedule((dir / "conveyor_no_such_schedule.txt").string()), ScheduleError);
}

// What `conveyor schedule --dump` writes loads again at its size: 1F1B at p=64, m=16384, the
// 2^20 cells --dump takes, is a text file of 73 MB.
TEST(TextFormat, TheLargestDumpLoadsAgain) {
  const Schedule s = generate_1f1b(64, 16384);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("conveyor_sched_large_" + std::to_string(::getpid()) + ".txt"))
                               .string();
  struct Removed {
    const std::string& path;
    ~Removed() { std::remove(path.c_str()); }
  } removed{path};
  save_schedule(path, s);
  ASSERT_GT(std::filesystem::file_size(path), 64u << 20);
  EXPECT_TRUE(load_schedule(path) == s);
}

// A file name may hold a line break: the error names it escaped, on one line.
TEST(TextFormat, ASaveThatCannotOpenItsFileNamesItOnOneLine) {
  const std::string path = "/nonexistent/two\nlines.txt";
  try {
    save_schedule(path, generate_1f1b(2, 2));
    ADD_FAILURE() << "a schedule was saved under a folder that does not exist";
  } catch (const ScheduleError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot open '/nonexistent/two\\nlines.txt' for writing");
  }
}

TEST(TextFormat, HandWrittenWithoutHeaderIsInferred) {
  const Schedule s = parse_text(
      "# two stages, hand-written\n"
      "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1\n"
      "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 SG1.1>0\n");
  EXPECT_EQ(s.num_ranks(), 2);
  EXPECT_EQ(s.placement.chunks, 1);
  EXPECT_EQ(s.num_microbatches, 2);
  EXPECT_NO_THROW(validate(s));
}

// A file an editor saved with a UTF-8 byte-order mark, with CRLF line ends, reads as the same
// schedule, in either format.
TEST(TextFormat, AByteOrderMarkAndCrlfAreTheSameFile) {
  const Schedule s = generate_1f1b(2, 3);
  for (const std::string& text : {dump_text(s), dump_csv(s)}) {
    std::string edited = "\xEF\xBB\xBF";
    for (const char c : text) edited += c == '\n' ? std::string("\r\n") : std::string(1, c);
    EXPECT_EQ(parse_schedule(edited), s) << edited;
    EXPECT_EQ(parse_schedule("\xEF\xBB\xBF" + text), s) << text;
  }
}

// A header typed by hand, with a tab or without the space after '#', is still the header: read
// as a comment, its chunks=2 layout=v would be lost and the V's stages refused as misplaced.
TEST(TextFormat, AHeaderSpacedByHandIsStillTheHeader) {
  const Schedule s = generate_zbv(2, 3);
  const std::string text = dump_text(s);
  const std::string header = "# conveyor schedule:";
  ASSERT_EQ(text.substr(0, header.size()), header);
  const std::string body = text.substr(header.size());
  for (const std::string& typed :
       {"#conveyor schedule:", "#\tconveyor\tschedule:", "#  conveyor  schedule:"}) {
    const std::string edited = typed + body;
    EXPECT_EQ(parse_schedule(edited), s) << edited;
  }
  std::string tabbed = text.substr(0, text.find('\n'));
  for (char& c : tabbed)
    if (c == ' ') c = '\t';
  EXPECT_EQ(parse_schedule(tabbed + text.substr(text.find('\n'))), s) << tabbed;
}

// The message parse_schedule throws for `text`, or "no error".
std::string message_of(const std::string& text) {
  try {
    parse_schedule(text);
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "no error";
}

// A file that is not ASCII or UTF-8 text is said to be so, whole: a NUL byte would end the
// message at it, and UTF-16 (PowerShell's '>', Notepad's "Unicode") holds one in every
// character.
TEST(TextFormat, UTF16AndNulBytesAreRefusedAsNotText) {
  const std::string text = dump_text(generate_1f1b(2, 2));
  std::string utf16 = "\xFF\xFE";
  for (const char c : text) utf16 += std::string(1, c) + '\0';
  EXPECT_EQ(message_of(utf16),
            "the file is UTF-16 (it starts with the byte-order mark FF FE); save it as UTF-8 or "
            "ASCII text");
  std::string big_endian = "\xFE\xFF";
  for (const char c : text) big_endian += std::string(1, '\0') + c;
  EXPECT_EQ(message_of(big_endian),
            "the file is UTF-16 (it starts with the byte-order mark FE FF); save it as UTF-8 or "
            "ASCII text");
  EXPECT_EQ(message_of("r0: F0.0\nr0: F0.0" + std::string(1, '\0') + " B0.0\n"),
            "line 2 holds a NUL byte; a schedule file is text (UTF-8 or ASCII)");
}

// Line ends of a lone carriage return (classic Mac OS) make the whole file one line, which
// would read as one comment: an empty schedule.
TEST(TextFormat, LoneCarriageReturnsAreRefused) {
  std::string text = dump_text(generate_1f1b(2, 2));
  for (char& c : text)
    if (c == '\n') c = '\r';
  EXPECT_EQ(message_of(text),
            "line 1 ends in a carriage return without a line feed (classic Mac OS line ends); "
            "save the file with LF or CRLF line ends");
  EXPECT_EQ(message_of("r0: F0.0\r\nr0: F0.0\rB0.0\n"),
            "line 2 ends in a carriage return without a line feed (classic Mac OS line ends); "
            "save the file with LF or CRLF line ends");
}

TEST(TextFormat, ErrorsNameTheLine) {
  EXPECT_NE(message_of("r0: F0.0\nr1: F1.0 Q1.0\n").find("line 2"), std::string::npos);
  EXPECT_NE(message_of("# conveyor schedule: ranks=two\nr0: F0.0\n").find("ranks"),
            std::string::npos);
  EXPECT_NE(message_of("# conveyor schedule: layout=zigzag\nr0: F0.0\n").find("layout"),
            std::string::npos);
  EXPECT_NE(message_of("hello\n").find("line 1"), std::string::npos);
  EXPECT_NE(message_of("r0: F0.0\nr0: B0.0\n").find("twice"), std::string::npos);
  EXPECT_NE(message_of("# conveyor schedule: ranks=1\nr0: F0.0\nr1: F1.0\n").find("ranks=1"),
            std::string::npos);
  EXPECT_NE(message_of("").find("empty"), std::string::npos);
  EXPECT_EQ(message_of("# conveyor schedule: name= ranks=1\nr0: F0.0\n"),
            "line 1: header entry 'name=' has no value; give one or leave name out");
  EXPECT_NE(message_of("rank,step,kind,stage,microbatch,peer\n0,1,F,0,0,\n").find("step"),
            std::string::npos);
  EXPECT_NE(message_of("rank,step,kind,stage,microbatch,peer\n0,0,FWD,0,0,\n").find("unknown kind"),
            std::string::npos);
  EXPECT_NE(message_of("rank,step,kind,stage,microbatch,peer\n0,0,F,0,0\n").find("6"),
            std::string::npos);
  EXPECT_NE(message_of("rank,step,kind,stage,microbatch,peer\n0,0,SEND_ACT,0,0,\n").find("peer"),
            std::string::npos);
}

// A rank the file counts but gives no actions is a line left out: said as such, in text and
// CSV, rather than as a transfer to it missing on some other rank (the validator's view).
TEST(TextFormat, ARankWithoutActionsIsALineLeftOut) {
  const std::string r0 = "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1\n";
  const std::string r1 = "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 SG1.1>0\n";
  const std::string header = "# conveyor schedule: name=1f1b ranks=3 chunks=1 microbatches=2\n";
  const std::string said = "has no actions (expected a line 'r";
  EXPECT_EQ(message_of(header + r0 + r1).find("rank 2 of 3 " + said + "2: "), 0u)
      << message_of(header + r0 + r1);
  EXPECT_EQ(message_of("r0: F0.0\nr2: F2.0\n").find("rank 1 of 3 " + said + "1: "), 0u);
  EXPECT_EQ(message_of(header + r0 + "r1:\nr2: F2.0\n").find("rank 1 of 3 " + said), 0u);
  EXPECT_EQ(message_of(header + "rank,step,kind,stage,microbatch,peer\n0,0,F,0,0,\n")
                .find("rank 1 of 3 " + said),
            0u);
}

// A header that counts more chunks than the actions use leaves stages without actions: named
// as such, with the chunk count that fits, not as a transfer to the first of them missing.
TEST(TextFormat, StagesNoActionNamesAreAChunkCountTooLarge) {
  const std::string actions =
      "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1\n"
      "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 SG1.1>0\n";
  EXPECT_EQ(
      message_of("# conveyor schedule: name=1f1b ranks=2 chunks=2 microbatches=2\n" + actions),
      "the header's chunks=2 makes 4 stages (2 ranks x 2 chunks), but the actions name "
      "stages 0 to 1 only; every stage runs its forwards and backwards (chunks=1 fits these "
      "actions)");
  EXPECT_EQ(message_of("# conveyor schedule: ranks=2 chunks=1\n" + actions), "no error");
}

// A header naming a generated kind promises that kind's shape, which the name's readers
// (the report, a checkpoint, the planner's advice that regenerates the kind) rely on: a file
// that cannot have it is refused, naming the entry and what the kind needs.
TEST(TextFormat, AKindNameTheFileCannotBeIsRefused) {
  const std::string looped =
      "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1\n"
      "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 SG1.1>0\n";
  const std::string tail =
      "; a file named after a kind has its shape, so give this one another name or none";
  EXPECT_EQ(message_of("# conveyor schedule: name=zbv ranks=2 chunks=1 microbatches=2\n" + looped),
            "the header's name=zbv is a kind of 2 chunks per rank, but the file has 1" + tail);
  EXPECT_EQ(message_of("# conveyor schedule: name=zbh1 ranks=2 microbatches=2\n" + looped),
            "the header's name=zbh1 is a kind whose backward is split into I and W, but the "
            "file has no I or W action" +
                tail);
  // The same file as interleaved v=1, or nameless, or under a name of its own, loads.
  for (const char* name : {"1f1b", "interleaved", "gpipe", "mine"})
    EXPECT_EQ(message_of(std::string("# conveyor schedule: name=") + name + "\n" + looped),
              "no error")
        << name;
  EXPECT_EQ(message_of(looped), "no error");

  const Schedule zbv = generate_zbv(2, 2);
  std::string as_1f1b = dump_text(zbv);
  as_1f1b.replace(as_1f1b.find("name=zbv"), 8, "name=1f1b");
  EXPECT_EQ(message_of(as_1f1b),
            "the header's name=1f1b is a kind of 1 chunk per rank, but the file has 2" + tail);
  std::string looped_zbv = dump_text(zbv);
  looped_zbv.replace(looped_zbv.find("layout=v"), 8, "layout=looped");
  EXPECT_EQ(message_of(looped_zbv)
                .find("the header's name=zbv is a kind laid out in a V "
                      "(layout=v), but the file has layout=looped" +
                      tail),
            0u)
      << message_of(looped_zbv);
  std::string v_interleaved = dump_text(generate_interleaved(2, 2, 2));
  v_interleaved.replace(v_interleaved.find("layout=looped"), 13, "layout=v");
  EXPECT_EQ(message_of(v_interleaved)
                .find("the header's name=interleaved is a kind laid out "
                      "looped (layout=looped), but the file has layout=v"),
            0u)
      << message_of(v_interleaved);
}

// A header entry given twice, on one header line or two, is refused: the later value would
// replace the first without a word.
TEST(TextFormat, AHeaderEntryGivenTwiceIsRefused) {
  const std::string actions = "r0: F0.0 B0.0\nr1: F1.0 B1.0\n";
  EXPECT_EQ(message_of("# conveyor schedule: ranks=3 ranks=2\n" + actions),
            "line 1: header entry 'ranks' is given twice (ranks=3, then ranks=2); give it once");
  EXPECT_EQ(message_of("# conveyor schedule: name=a\n# conveyor schedule: name=b\n" + actions),
            "line 2: header entry 'name' is given twice (name=a, then name=b); give it once");
}

// A token of a file may be megabytes long (a line without spaces): the message shows its
// start, one short line, in every error that quotes one.
TEST(TextFormat, LongTokensAreShownByTheirStart) {
  const std::string big(1 << 20, 'Q');
  const std::string columns = "rank,step,kind,stage,microbatch,peer\n";
  for (const std::string& text :
       {"r0: F0.0 " + big + "\n", columns + "0,0," + big + ",0,0,\n",
        columns + "0," + big + ",F,0,0,\n", "# conveyor schedule: " + big + "\nr0: F0.0\n",
        "# conveyor schedule: layout=" + big + "\nr0: F0.0\n",
        "# conveyor schedule: " + big + "=1\nr0: F0.0\n", "r" + big + ": F0.0\n",
        "# conveyor schedule: name=" + big + " name=b\nr0: F0.0\n"}) {
    const std::string message = message_of(text);
    EXPECT_LT(message.size(), 300u) << message.substr(0, 300);
    EXPECT_NE(message.find("QQQ..."), std::string::npos) << message.substr(0, 300);
  }
}

// A CSV file whose column line a spreadsheet recased or spaced is read as CSV, and the error
// names the column line expected, not the text format's 'r<rank>: <actions>'.
TEST(TextFormat, AColumnLineNotAsWrittenIsNamedAsSuch) {
  const std::string rows = "0,0,F,0,0,\n0,1,B,0,0,\n";
  for (const std::string columns :
       {"Rank,Step,Kind,Stage,Microbatch,Peer", "rank, step, kind, stage, microbatch, peer"})
    EXPECT_EQ(message_of(columns + "\n" + rows),
              "line 1: expected the column line 'rank,step,kind,stage,microbatch,peer', got '" +
                  columns + "'");
  EXPECT_EQ(message_of("r0: F0.0,B0.0\n").find("line 1: malformed action 'F0.0,B0.0'"), 0u);
}

// CSV saved by a spreadsheet in a locale with a decimal comma separates its fields by ';':
// said so, with or without the column line, not read as a text line that lacks 'r<rank>:'.
TEST(TextFormat, SemicolonSeparatedCsvIsNamedAsSuch) {
  EXPECT_EQ(message_of("# conveyor schedule: ranks=1\nrank;step;kind;stage;microbatch;peer\n"
                       "0;0;F;0;0;\n0;1;B;0;0;\n"),
            "line 2: the fields are separated by ';', and a schedule's CSV separates them by ',' "
            "(rank,step,kind,stage,microbatch,peer); got 'rank;step;kind;stage;microbatch;peer'");
  EXPECT_EQ(message_of("0;0;F;0;0;\n").find("line 1: the fields are separated by ';'"), 0u);
}

// A '#' starts a comment after a rank's actions as on a line of its own; in CSV, where a
// spreadsheet would make it a cell, a comment takes a whole line.
TEST(TextFormat, CommentsAfterActionsAndInCsv) {
  const Schedule plain = parse_schedule("r0: F0.0 B0.0\nr1: F1.0 B1.0\n");
  EXPECT_EQ(parse_schedule("r0: F0.0 B0.0  # warm-up\nr1: F1.0 B1.0#x\n# end\n"), plain);
  EXPECT_EQ(message_of("r0: # nothing yet\nr1: F1.0 B1.0\n").find("rank 0 of 2 has no actions"),
            0u);
  EXPECT_EQ(message_of("rank,step,kind,stage,microbatch,peer\n0,0,F,0,0, # warm-up\n"),
            "line 2: a comment in a CSV file takes a whole line starting with '#', got "
            "'0,0,F,0,0, # warm-up'");
  EXPECT_EQ(message_of("# a comment\nrank,step,kind,stage,microbatch,peer\n0,0,F,0,0,\n"
                       "0,1,B,0,0,\n"),
            "no error");
}

// Numbers past what a schedule may hold are refused as too large (naming the limit), before
// the counts inferred from them are computed; the stage and micro-batch limits are the
// header's, for files without one.
TEST(TextFormat, NumbersPastTheLimitsAreTooLarge) {
  EXPECT_EQ(message_of("r99999999999: F0.0\n"),
            "line 1: rank 99999999999 is larger than supported (65535)");
  EXPECT_EQ(message_of("r65536: F0.0\n"), "line 1: rank 65536 is larger than supported (65535)");
  EXPECT_EQ(message_of("# conveyor schedule: ranks=4294967296\nr0: F0.0\n"),
            "line 1: ranks 4294967296 is larger than supported (65536)");
  EXPECT_EQ(message_of("# conveyor schedule: microbatches=1048577\nr0: F0.0\n"),
            "line 1: microbatches 1048577 is larger than supported (1048576)");
  EXPECT_EQ(message_of("r0: F2147483647.0\n"),
            "an action names stage 2147483647; at most 65536 stages (0 to 65535) are supported");
  EXPECT_EQ(message_of("r0: F0.1048576\n"),
            "an action names micro-batch 1048576; at most 1048576 micro-batches (0 to 1048575) "
            "are supported");
  EXPECT_EQ(message_of("r0: F65535.1048575\n"), "no error");
  EXPECT_EQ(message_of("# conveyor schedule: replicas=2\nr0: F0.0 B0.0 AR0.1048576\n"),
            "an action names all-reduce bucket 1048576; at most 1048576 buckets (0 to 1048575) "
            "are supported");
}

// An action's numbers past int are too large as well, not malformed: the message names the
// number and the largest a file may hold, in text and CSV alike.
TEST(TextFormat, ActionNumbersPastIntAreTooLarge) {
  EXPECT_EQ(message_of("r0: F9223372036854775808.0 B0.0\n"),
            "line 1: action 'F9223372036854775808.0': stage 9223372036854775808 is larger than "
            "supported (65535)");
  EXPECT_EQ(message_of("r0: F0.4294967296\n"),
            "line 1: action 'F0.4294967296': micro-batch 4294967296 is larger than supported "
            "(1048575)");
  EXPECT_EQ(message_of("r0: F0.0 SA0.0>4294967296\n"),
            "line 1: action 'SA0.0>4294967296': peer rank 4294967296 is larger than supported "
            "(65535)");
  EXPECT_EQ(message_of("r0: AR4294967296\n"),
            "line 1: action 'AR4294967296': stage 4294967296 is larger than supported (65535)");
  EXPECT_EQ(message_of("r0: AR0.4294967296\n"),
            "line 1: action 'AR0.4294967296': bucket 4294967296 is larger than supported "
            "(1048575)");
  // Signs and other characters are no number at all.
  EXPECT_EQ(message_of("r0: F-9223372036854775809.0\n")
                .find("line 1: malformed action 'F-9223372036854775809.0': bad stage"),
            0u);
  EXPECT_EQ(message_of("r0: F0.99999999999x\n")
                .find("line 1: malformed action 'F0.99999999999x': bad micro-batch"),
            0u);
  const std::string csv = "rank,step,kind,stage,microbatch,peer\n";
  EXPECT_EQ(message_of(csv + "0,0,F,9223372036854775808,0,\n"),
            "line 2: stage 9223372036854775808 is larger than supported (65535)");
  EXPECT_EQ(message_of(csv + "0,0,F,0,4294967296,\n"),
            "line 2: microbatch 4294967296 is larger than supported (1048575)");
  EXPECT_EQ(message_of(csv + "0,0,SEND_ACT,0,0,4294967296\n"),
            "line 2: peer 4294967296 is larger than supported (65535)");
}

// The buckets of an all-reduce (AR0.3) are not micro-batches: a header without `microbatches`
// leaves the count to the forwards and backwards alone.
TEST(TextFormat, BucketsDoNotCountAsMicrobatches) {
  const Schedule s = parse_text(
      "# conveyor schedule: ranks=2 replicas=2\n"
      "r0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1 AR0 AR0.1 AR0.2\n"
      "r1: RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 AR1 AR1.1 AR1.2 AR1.3 SG1.1>0\n");
  EXPECT_EQ(s.num_microbatches, 2);
  EXPECT_NO_THROW(validate(s));
}

}  // namespace
}  // namespace conveyor::schedule
