#pragma once
// Conveyor as a library: everything an application needs to describe a model, bring its data
// and train it through a pipeline. Include this one header and link conveyor::conveyor.
//
//   describe a model    ModelDescription (layers/model.h): units from a factory, the shape of
//                       the activation between them; reference_model(ModelConfig) is one
//   write a layer       Layer, SavedTensors, MicroBatchInputs (layers/layer.h), Parameter and
//                       InitSpec (layers/parameter.h), the tensor-level ops (layers/ops.h)
//   built-in layers     Linear, Activation, LayerNorm, Embedding, MlpBlock, LossHead
//   data                TokenSource and the built-in MarkovSource, FileSource; a data file
//                       that cannot be read (TrainConfig::data_path, FileSource) throws
//                       InputFileError (engine/schedule/input_file.h), a std::invalid_argument
//   train               TrainConfig, Trainer (step, evaluate), PartitionSpec, ScheduleKind
//   checkpoints         TrainerCheckpointer and resume_trainer (engine/train/trainer_checkpoint.h);
//                       CheckpointWriter, open_checkpoint and Checkpoint::read, tensors by
//                       global name (engine/train/checkpoint.h); a model's tensors under those
//                       names (engine/train/checkpoint_model.h); docs/checkpoint-format.md
//   balance             profile_units (engine/pipeline/profile.h) measures each unit's time
//                       and memory on a device; plan() (engine/pipeline/planner.h) ranks the
//                       schedules, micro-batch counts and exact partitions by simulated step
//                       time, and apply_plan sets a TrainConfig from the chosen one;
//                       described_unit_costs (engine/pipeline/memory_estimate.h) is what the
//                       layers say they keep (Layer::activation_memory), to check against it
//   devices             Device, resolve_device, cuda_device_count; version()
// Only the headers this one includes (and theirs) are installed.
#include "engine/core/device.h"
#include "engine/core/device_context.h"
#include "engine/core/tensor.h"
#include "engine/core/version.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/optimizer.h"
#include "engine/pipeline/partition.h"
#include "engine/pipeline/planner.h"
#include "engine/pipeline/profile.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint.h"
#include "engine/train/checkpoint_model.h"
#include "engine/train/data.h"
#include "engine/train/trainer.h"
#include "engine/train/trainer_checkpoint.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"
#include "layers/layer.h"
#include "layers/model.h"
#include "layers/ops.h"
#include "layers/parameter.h"
