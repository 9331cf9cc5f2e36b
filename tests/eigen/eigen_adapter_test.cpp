// The Eigen adapter (<ddp/eigen.hpp>): dtypes and contiguity of dense and Tensor-module types,
// and a tiny model with Eigen parameters (a MatrixXf, a fixed-size f64 Array and a rank-3
// Eigen::Tensor) trained through a Bucketer over 1-4 local ranks, bit-identical to a serial
// reference that computes every rank's gradient and averages them as the Bucketer does.
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/eigen.hpp>
#include <ddp/local.hpp>
#include <ddp/strategies/allreduce.hpp>

using Catch::Matchers::Contains;

// ---- traits --------------------------------------------------------------------------------------

static_assert(ddp::tensor<Eigen::MatrixXf> && ddp::tensor<Eigen::Matrix4d> && ddp::tensor<Eigen::VectorXi>);
static_assert(ddp::tensor<Eigen::ArrayXXf> && ddp::tensor<Eigen::Array<std::int64_t, 3, 1>>);
static_assert(ddp::tensor<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>);
static_assert(ddp::tensor<Eigen::Map<Eigen::MatrixXf>> && ddp::tensor<Eigen::Ref<Eigen::VectorXd>>);
static_assert(ddp::tensor<Eigen::Tensor<float, 3>> && ddp::tensor<Eigen::TensorFixedSize<double, Eigen::Sizes<2, 3>>>);
static_assert(ddp::tensor<Eigen::TensorMap<Eigen::Tensor<std::int32_t, 2>>>);
// Not tensors: const coefficients (ddp writes), scalars without a dtype, expressions.
static_assert(!ddp::tensor<Eigen::Map<const Eigen::MatrixXf>> && !ddp::tensor<Eigen::Ref<const Eigen::VectorXf>>);
static_assert(!ddp::tensor<Eigen::TensorMap<const Eigen::Tensor<float, 2>>>);
static_assert(!ddp::tensor<Eigen::MatrixXcf> && !ddp::tensor<Eigen::Matrix<bool, 2, 2>> &&
              !ddp::tensor<Eigen::Matrix<short, 2, 2>> && !ddp::tensor<Eigen::Tensor<std::int16_t, 1>>);
static_assert(!ddp::tensor<decltype(Eigen::MatrixXf() + Eigen::MatrixXf())>);

TEST_CASE("Eigen scalars map to ddp dtypes", "[eigen][tensor]") {
  Eigen::Matrix<Eigen::half, 2, 3> h;
  Eigen::Array<Eigen::bfloat16, Eigen::Dynamic, 1> bf(5);
  Eigen::MatrixXf f(2, 3);
  Eigen::Matrix<double, 4, 4> d;
  Eigen::Matrix<std::int8_t, 3, 1> i8;
  Eigen::Array<std::uint8_t, 3, 1> u8;
  Eigen::VectorXi i32(7);
  Eigen::Array<std::int64_t, Eigen::Dynamic, Eigen::Dynamic> i64(2, 2);
  CHECK(ddp::view(h).type == ddp::dtype::f16);
  CHECK(ddp::view(bf).type == ddp::dtype::bf16);
  CHECK(ddp::view(f).type == ddp::dtype::f32);
  CHECK(ddp::view(d).type == ddp::dtype::f64);
  CHECK(ddp::view(i8).type == ddp::dtype::i8);
  CHECK(ddp::view(u8).type == ddp::dtype::u8);
  CHECK(ddp::view(i32).type == ddp::dtype::i32);
  CHECK(ddp::view(i64).type == ddp::dtype::i64);
  CHECK(ddp::view(h).count == 6);
  CHECK(ddp::view(bf).count == 5);
  CHECK(ddp::view(d).count == 16);
  CHECK(ddp::view(d).data == d.data());
  CHECK(ddp::view(d).where == ddp::device::host());
  // Eigen's 2-byte floats have ddp's encodings.
  h(0, 0) = Eigen::half(1.5f);
  bf(0) = Eigen::bfloat16(-2.25f);
  CHECK(static_cast<float>(ddp::view(h).as<ddp::half>()[0]) == 1.5f);
  CHECK(static_cast<float>(ddp::view(bf).as<ddp::bfloat16>()[0]) == -2.25f);
}

TEST_CASE("Eigen maps and refs must be contiguous; Tensor-module types always are", "[eigen][tensor]") {
  Eigen::MatrixXf big = Eigen::MatrixXf::Zero(4, 6);
  Eigen::Map<Eigen::MatrixXf> whole(big.data(), 4, 6);
  CHECK(ddp::view(whole).count == 24);
  Eigen::Ref<Eigen::MatrixXf> columns = big.middleCols(1, 2);  // column-major: columns are contiguous
  CHECK(ddp::view(columns).count == 8);
  CHECK(ddp::view(columns).data == big.data() + 4);

  Eigen::Ref<Eigen::MatrixXf> block = big.block(0, 0, 2, 3);  // rows 0-1 of 4: gaps
  REQUIRE_THROWS_AS(ddp::view(block), ddp::usage_error);
  REQUIRE_THROWS_WITH(ddp::view(block),
                      Contains("2x3") && Contains("outer stride 4") && Contains("not one contiguous block"));
  Eigen::Map<Eigen::VectorXf, 0, Eigen::InnerStride<2>> every_other(big.data(), 12, Eigen::InnerStride<2>());
  REQUIRE_THROWS_WITH(ddp::view(every_other), Contains("inner stride 2"));

  Eigen::Tensor<float, 3> t(2, 3, 4);
  Eigen::TensorFixedSize<double, Eigen::Sizes<2, 5>> fixed;
  Eigen::TensorMap<Eigen::Tensor<float, 2>> tmap(big.data(), 6, 4);
  CHECK(ddp::view(t).count == 24);
  CHECK(ddp::view(t).type == ddp::dtype::f32);
  CHECK(ddp::view(fixed).count == 10);
  CHECK(ddp::view(fixed).type == ddp::dtype::f64);
  CHECK(ddp::view(tmap).data == big.data());

  // A Bucketer rejects a strided map at add().
  ddp::local::world w(1);
  auto comm = w.rank(0);
  ddp::Bucketer grads(comm);
  REQUIRE_THROWS_WITH(grads.add(block), Contains("not one contiguous block"));
}

TEST_CASE("Eigen buffers in a BufferReducer", "[eigen][buffer_reducer]") {
  std::vector<Eigen::ArrayXf> means(3);
  std::vector<Eigen::Tensor<std::int64_t, 1>> sums(3);
  ddp::local::run(3, [&](ddp::local::communicator& c) {  // (Catch2 assertions stay on the main thread)
    ddp::BufferReducer buffers(c);
    Eigen::ArrayXf running = Eigen::ArrayXf::Constant(5, static_cast<float>(c.rank()));
    Eigen::Tensor<std::int64_t, 1> seen(2);
    seen.setConstant(c.rank() + 1);
    buffers.add(running, ddp::strategies::allreduce_mean{});
    buffers.add(seen, ddp::strategies::allreduce_sum{});
    buffers.sync();
    means[static_cast<std::size_t>(c.rank())] = running;
    sums[static_cast<std::size_t>(c.rank())] = seen;
  });
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK((means[r] == 1.0f).all());
    CHECK(sums[r](0) == 6);
    CHECK(sums[r](1) == 6);
  }
}

// ---- training: Bucketer over local ranks vs a serial reference ------------------------------------

namespace {

constexpr int in = 5, out = 3, per_rank = 6, steps = 12;
constexpr float lr = 0.1f;

// y = W x + b + Q(x, x): a MatrixXf, a fixed-size f64 Array and a rank-3 Eigen::Tensor.
struct model {
  Eigen::MatrixXf W = Eigen::MatrixXf::Zero(out, in), gW = Eigen::MatrixXf::Zero(out, in);
  Eigen::Array<double, out, 1> b = Eigen::Array<double, out, 1>::Zero(), gb = Eigen::Array<double, out, 1>::Zero();
  Eigen::Tensor<float, 3> Q{out, in, in}, gQ{out, in, in};

  model() {
    for (int o = 0; o < out; ++o) {
      for (int i = 0; i < in; ++i) {
        W(o, i) = 0.1f * static_cast<float>((o * 7 + i * 3) % 5) - 0.2f;
        for (int j = 0; j < in; ++j) Q(o, i, j) = 0.01f * static_cast<float>((o + 2 * i + 3 * j) % 7) - 0.03f;
      }
    }
    gQ.setZero();
  }

  // Mean squared error on `n` samples: writes the gradients.
  void gradients(const std::vector<float>& x, const std::vector<float>& y, int n) {
    gW.setZero();
    gb.setZero();
    gQ.setZero();
    for (int s = 0; s < n; ++s) {
      const float* xs = x.data() + s * in;
      for (int o = 0; o < out; ++o) {
        float pred = static_cast<float>(b(o));
        for (int i = 0; i < in; ++i) {
          pred += W(o, i) * xs[i];
          for (int j = 0; j < in; ++j) pred += Q(o, i, j) * xs[i] * xs[j];
        }
        const float e = (pred - y[static_cast<std::size_t>(s * out + o)]) / static_cast<float>(n);
        gb(o) += static_cast<double>(e);
        for (int i = 0; i < in; ++i) {
          gW(o, i) += e * xs[i];
          for (int j = 0; j < in; ++j) gQ(o, i, j) += e * xs[i] * xs[j];
        }
      }
    }
  }

  void sgd() {
    W -= lr * gW;
    b -= static_cast<double>(lr) * gb;
    Q -= gQ * lr;
  }

  [[nodiscard]] std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> v;
    auto put = [&](const void* p, std::size_t n) {
      const auto* c = static_cast<const unsigned char*>(p);
      v.insert(v.end(), c, c + n);
    };
    put(W.data(), sizeof(float) * static_cast<std::size_t>(W.size()));
    put(b.data(), sizeof(double) * out);
    put(Q.data(), sizeof(float) * static_cast<std::size_t>(Q.size()));
    return v;
  }
};

// Rank r's samples at a step: x in [-1, 1), y a fixed function of x.
void shard(int step, int rank, std::vector<float>& x, std::vector<float>& y) {
  x.resize(per_rank * in);
  y.resize(per_rank * out);
  std::uint64_t state = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(step * 131 + rank + 1);
  for (auto& v : x) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(state >> 40) / 8388608.0f - 1.0f;
  }
  for (int s = 0; s < per_rank; ++s) {
    for (int o = 0; o < out; ++o) {
      float t = 0.5f * static_cast<float>(o);
      for (int i = 0; i < in; ++i) t += static_cast<float>((o + i) % 3 - 1) * x[static_cast<std::size_t>(s * in + i)];
      y[static_cast<std::size_t>(s * out + o)] = t * t;
    }
  }
}

std::vector<unsigned char> train_distributed(ddp::communicator_ref comm) {
  model m;
  // Small buckets: the three parameters land in several buckets of two dtypes.
  ddp::Bucketer grads(comm, ddp::bucketing::size_capped{.cap_bytes = 128, .small_bucket_bytes = 64});
  grads.add(m.W, m.gW);
  grads.add(m.b, m.gb);
  grads.add(m.Q, m.gQ);
  grads.build();
  std::vector<float> x, y;
  for (int step = 0; step < steps; ++step) {
    shard(step, comm.rank(), x, y);
    m.gradients(x, y, per_rank);
    grads.mark_ready(2);
    grads.mark_ready(1);
    grads.mark_ready(0);
    grads.finalize();
    m.sgd();
  }
  return m.bytes();
}

// What the Bucketer computes, without it: every rank's gradient times 1/N (the copy into the
// bucket), summed in rank order (the local backend's order), then the same SGD step.
std::vector<unsigned char> train_serial(int ranks) {
  model m;
  std::vector<float> x, y;
  const float ff = static_cast<float>(1.0 / ranks);
  const double fd = 1.0 / ranks;
  for (int step = 0; step < steps; ++step) {
    Eigen::MatrixXf aW(out, in);
    Eigen::Array<double, out, 1> ab;
    Eigen::Tensor<float, 3> aQ(out, in, in);
    for (int r = 0; r < ranks; ++r) {
      shard(step, r, x, y);
      m.gradients(x, y, per_rank);
      for (Eigen::Index i = 0; i < aW.size(); ++i)
        aW.data()[i] = r == 0 ? m.gW.data()[i] * ff : aW.data()[i] + m.gW.data()[i] * ff;
      for (Eigen::Index i = 0; i < ab.size(); ++i)
        ab.data()[i] = r == 0 ? m.gb.data()[i] * fd : ab.data()[i] + m.gb.data()[i] * fd;
      for (Eigen::Index i = 0; i < aQ.size(); ++i)
        aQ.data()[i] = r == 0 ? m.gQ.data()[i] * ff : aQ.data()[i] + m.gQ.data()[i] * ff;
    }
    m.gW = aW;
    m.gb = ab;
    m.gQ = aQ;
    m.sgd();
  }
  return m.bytes();
}

}  // namespace

TEST_CASE("a model with Eigen parameters trains bit-identically to a serial reference", "[eigen][bucketer][local]") {
  for (int ranks = 1; ranks <= 4; ++ranks) {
    CAPTURE(ranks);
    const std::vector<unsigned char> expected = train_serial(ranks);
    std::vector<std::vector<unsigned char>> got(static_cast<std::size_t>(ranks));
    ddp::local::run(
        ranks, [&](ddp::local::communicator& c) { got[static_cast<std::size_t>(c.rank())] = train_distributed(c); });
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(got[static_cast<std::size_t>(r)] == expected);
    }
    // and training changed something (the comparison is not between two initial models)
    CHECK(expected != model().bytes());
  }
}
