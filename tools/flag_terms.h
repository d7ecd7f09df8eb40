#pragma once
// The library's messages name its own settings (TrainConfig::stages, Device::cpu(), ...); the
// command line shows them as the flags that set them (--stages, --device cpu).
#include <string>

namespace conveyor::cli {

// `message` with every setting of the library that a flag gives replaced by that flag. A name
// is replaced only whole: TrainConfig::steps, not the start of a longer name.
std::string in_flag_terms(const std::string& message);

}  // namespace conveyor::cli
