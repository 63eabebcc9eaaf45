// A safetensors file (executor/safetensors.h: SafetensorsFile::open validates the header, every
// offset and size), then every tensor of up to 64 Ki elements read as fp32 where its dtype
// converts. The reader maps a file, so the bytes go through a temporary file of this process.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "fuzz_target.h"
#include "peftplan/executor/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace peftplan;
  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("peftplan-fuzz-" + std::to_string(::getpid()) + ".safetensors");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  fuzz::parse_or_refuse(path.filename().string(), [&] {
    const executor::SafetensorsFile f = executor::SafetensorsFile::open(path);
    for (const executor::StTensorInfo& t : f.tensors()) {
      if (t.numel() > (1 << 16)) continue;
      if (t.dtype != executor::StDtype::F32 && t.dtype != executor::StDtype::F16 && t.dtype != executor::StDtype::BF16 &&
          t.dtype != executor::StDtype::F64)
        continue;
      std::vector<float> v(static_cast<std::size_t>(t.numel()));
      f.read_f32(t.name, v);
    }
  });
  std::filesystem::remove(path);
  return 0;
}
