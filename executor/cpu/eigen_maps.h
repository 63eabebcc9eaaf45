// Eigen views over caller-owned, row-major buffers: the only way kernels touch Eigen.
// Maps never allocate; products are written with noalias() so Eigen evaluates them in place.
// Private to executor/cpu: public headers never include Eigen.
#pragma once

#include <Eigen/Core>

#include "peftplan/executor/kernels.h"

namespace peftplan::executor::cpu::detail {

template <typename T>
using MatR = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using Map = Eigen::Map<MatR<T>>;
template <typename T>
using CMap = Eigen::Map<const MatR<T>>;
// A [rows, cols] view whose rows are `stride` elements apart (one head inside [B,S,nh,d]).
template <typename T>
using SMap = Eigen::Map<MatR<T>, 0, Eigen::OuterStride<>>;
template <typename T>
using CSMap = Eigen::Map<const MatR<T>, 0, Eigen::OuterStride<>>;
template <typename T>
using VecMap = Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>;
template <typename T>
using CVecMap = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>;
template <typename T>
using CArrMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ArrMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;

// Below this many elements an elementwise loop runs on one thread.
inline constexpr Index kParallelMin = 1 << 14;

}  // namespace peftplan::executor::cpu::detail
