//! The MLP over quantized rows, for inference on the CPU.
//!
//! Dense (SiLU or ReLU): the gate and up rows against the quantized token, then the down
//! rows against the quantized activations, as llama.cpp runs a GGUF's MLP. Sparse
//! (ReLU): the gate rows are read whole, since a neuron's sign is only known once its
//! gate is computed, but only the active neurons' up rows and down columns are read:
//! at 5% density that is about a third of a dense MLP's bytes. The down projection is
//! kept transposed (`[d_ff, hidden]`, in Q8 whatever the other rows' format), so an
//! active neuron's column is a contiguous row, added in f32 scaled by its activation;
//! the activations are never rounded.

use rayon::prelude::*;

use candle_core::{Result, Tensor};

use super::Activation;
use crate::cpu::quant::{f32_rows, QuantFormat, QuantRows, QuantToken};

/// Active neurons per task when one token's neurons are split over the workers.
const NEURONS_PER_TASK: usize = 32;

/// The down projection, in the layout its path reads.
#[derive(Clone, Debug)]
enum Down {
    /// `[hidden, d_ff]`: dense, rows against the quantized activations.
    Rows(QuantRows),
    /// `[d_ff, hidden]`: sparse, one row per active neuron.
    Columns(QuantRows),
}

/// Gate, up and down weights quantized for the CPU.
#[derive(Clone, Debug)]
pub struct QuantizedMlp {
    gate: QuantRows,
    up: QuantRows,
    down: Down,
    activation: Activation,
}

/// What one pass computed: the output rows and the nonzero activations counted.
#[derive(Debug)]
pub struct QuantizedOutput {
    pub out: Vec<f32>,
    pub nonzeros: u64,
    /// How many tokens activated each neuron (`[d_ff]`), where asked for.
    pub fired: Option<Vec<u32>>,
}

impl QuantizedMlp {
    /// From f32 row-major HF weights `gate [f, d]`, `up [f, d]`, `down [d, f]`. `sparse`
    /// picks the layout of the down projection (and so the path); it needs ReLU.
    pub fn quantize(
        gate: &Tensor,
        up: &Tensor,
        down: &Tensor,
        activation: Activation,
        sparse: bool,
        format: QuantFormat,
    ) -> Result<Self> {
        let (f, d) = gate.dims2()?;
        let rows = |t: &Tensor, r: usize, c: usize| -> Result<QuantRows> {
            let v = t
                .to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            QuantRows::quantize(&v, r, c, format)
        };
        let down = if sparse {
            if activation != Activation::Relu {
                return Err(candle_core::Error::wrap(crate::TwellError::SparseNeedsRelu));
            }
            // Transposed, a Q4_1 matrix's blocks no longer match its grid; and the
            // sparse pass reads few of these rows. Q8 keeps them near exact.
            let columns = down.t()?.contiguous()?;
            let v = columns
                .to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            Down::Columns(QuantRows::quantize(&v, f, d, QuantFormat::Q8)?)
        } else {
            Down::Rows(rows(down, d, f)?)
        };
        Ok(Self {
            gate: rows(gate, f, d)?,
            up: rows(up, f, d)?,
            down,
            activation,
        })
    }

    pub fn hidden(&self) -> usize {
        self.gate.cols()
    }

    pub fn ffn(&self) -> usize {
        self.gate.rows()
    }

    /// Whether the pass reads only the active neurons' up and down weights.
    pub fn is_sparse(&self) -> bool {
        matches!(self.down, Down::Columns(_))
    }

    /// Bytes of the three projections.
    pub fn bytes(&self) -> usize {
        let down = match &self.down {
            Down::Rows(r) | Down::Columns(r) => r.bytes(),
        };
        self.gate.bytes() + self.up.bytes() + down
    }

    /// The MLP of `x` (`[rows, hidden]`, f32 on the CPU), row-major `[rows, hidden]`;
    /// with `count_fired`, also how often each neuron fired (for statistics).
    pub fn forward(&self, x: &Tensor, count_fired: bool) -> Result<QuantizedOutput> {
        let x = f32_rows(x, self.hidden(), "QuantizedMlp::forward")?;
        let f = self.ffn();
        let gate = self.gate.apply(&x)?;
        let fired = count_fired.then(|| {
            let mut fired = vec![0u32; f];
            let active = |g: f32| match self.activation {
                Activation::Relu => g > 0.0,
                Activation::Silu => true,
            };
            for row in gate.chunks_exact(f) {
                for (c, &g) in fired.iter_mut().zip(row) {
                    *c += u32::from(active(g));
                }
            }
            fired
        });
        let mut res = match &self.down {
            Down::Columns(columns) => {
                let tokens: Vec<QuantToken> =
                    x.chunks_exact(self.hidden()).map(QuantToken::new).collect();
                self.sparse(&tokens, &gate, columns)
            }
            Down::Rows(rows) => self.dense(&x, gate, rows)?,
        };
        res.fired = fired;
        Ok(res)
    }

    fn dense(&self, x: &[f32], mut h: Vec<f32>, down: &QuantRows) -> Result<QuantizedOutput> {
        let up = self.up.apply(x)?;
        let act = |g: f32| match self.activation {
            Activation::Silu => g / (1.0 + (-g).exp()),
            Activation::Relu => g.max(0.0),
        };
        for (h, u) in h.iter_mut().zip(&up) {
            *h = act(*h) * u;
        }
        let nonzeros = h.iter().filter(|&&v| v != 0.0).count() as u64;
        let out = down.apply(&h)?;
        Ok(QuantizedOutput {
            out,
            nonzeros,
            fired: None,
        })
    }

    fn sparse(&self, tokens: &[QuantToken], gate: &[f32], down: &QuantRows) -> QuantizedOutput {
        let (d, f) = (self.hidden(), self.ffn());
        // One token: its active neurons split over the workers; several: the tokens.
        let token_out = |t: usize, active: &[u32]| -> Vec<f32> {
            let mut y = vec![0f32; d];
            for &j in active {
                let j = j as usize;
                let h = gate[t * f + j] * self.up.dot(j, &tokens[t]);
                down.axpy(j, h, &mut y);
            }
            y
        };
        let active = |t: usize| -> Vec<u32> {
            (0..f as u32)
                .filter(|&j| gate[t * f + j as usize] > 0.0)
                .collect()
        };
        if tokens.len() == 1 {
            let a = active(0);
            let out = a
                .par_chunks(NEURONS_PER_TASK)
                .map(|chunk| token_out(0, chunk))
                .reduce(
                    || vec![0f32; d],
                    |mut y, z| {
                        crate::cpu::simd::add_assign(&mut y, &z);
                        y
                    },
                );
            return QuantizedOutput {
                out,
                nonzeros: a.len() as u64,
                fired: None,
            };
        }
        let rows: Vec<(Vec<f32>, usize)> = (0..tokens.len())
            .into_par_iter()
            .map(|t| {
                let a = active(t);
                (token_out(t, &a), a.len())
            })
            .collect();
        let nonzeros = rows.iter().map(|(_, n)| *n as u64).sum();
        QuantizedOutput {
            out: rows.into_iter().flat_map(|(y, _)| y).collect(),
            nonzeros,
            fired: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The f32 MLP, `down(act(gate x) * up x)`.
    fn reference(
        x: &Tensor,
        g: &Tensor,
        u: &Tensor,
        dn: &Tensor,
        act: Activation,
    ) -> Result<Tensor> {
        let gx = x.matmul(&g.t()?)?;
        let gx = match act {
            Activation::Silu => candle_nn::ops::silu(&gx)?,
            Activation::Relu => gx.relu()?,
        };
        (gx * x.matmul(&u.t()?)?)?.matmul(&dn.t()?)
    }

    fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
        let num = (a - b)?.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
        let den = b.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
        Ok(num / den.max(1e-30))
    }

    #[test]
    fn every_path_tracks_the_f32_mlp() -> Result<()> {
        let dev = Device::Cpu;
        let (d, f) = (96, 320);
        let g = Tensor::randn(0f32, 0.1, (f, d), &dev)?;
        let u = Tensor::randn(0f32, 0.1, (f, d), &dev)?;
        let dn = Tensor::randn(0f32, 0.1, (d, f), &dev)?;
        for m in [1usize, 3, 17, 40] {
            let x = Tensor::randn(0f32, 1.0, (m, d), &dev)?;
            for (act, sparse) in [
                (Activation::Silu, false),
                (Activation::Relu, false),
                (Activation::Relu, true),
            ] {
                for format in [QuantFormat::Q8, QuantFormat::Q4_1] {
                    let q = QuantizedMlp::quantize(&g, &u, &dn, act, sparse, format)?;
                    let got = q.forward(&x, false)?;
                    let got = Tensor::from_vec(got.out, (m, d), &dev)?;
                    // Against the f32 MLP of the weights the rows hold: only the
                    // tokens' (and the dense path's activations') int8 rounding is left.
                    let held = |r: &QuantRows| {
                        Tensor::from_vec(r.dequantize(), (r.rows(), r.cols()), &dev)
                    };
                    let held_down = match &q.down {
                        Down::Rows(r) => held(r)?,
                        Down::Columns(c) => held(c)?.t()?,
                    };
                    let want = reference(&x, &held(&q.gate)?, &held(&q.up)?, &held_down, act)?;
                    let e = rel_err(&got, &want)?;
                    assert!(e < 0.02, "{act:?} sparse {sparse} {format:?} m {m}: {e}");
                    if format == QuantFormat::Q8 {
                        let e = rel_err(&got, &reference(&x, &g, &u, &dn, act)?)?;
                        assert!(e < 0.03, "{act:?} sparse {sparse} Q8 m {m} vs f32: {e}");
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn the_sparse_path_counts_the_active_neurons_the_dense_path_finds() -> Result<()> {
        let dev = Device::Cpu;
        let (d, f) = (64, 256);
        let g = (Tensor::randn(0f32, 0.1, (f, d), &dev)? - 0.02)?;
        let u = Tensor::randn(0f32, 0.1, (f, d), &dev)?;
        let dn = Tensor::randn(0f32, 0.1, (d, f), &dev)?;
        let x = Tensor::randn(0f32, 1.0, (5, d), &dev)?;
        let sparse = QuantizedMlp::quantize(&g, &u, &dn, Activation::Relu, true, QuantFormat::Q8)?;
        let dense = QuantizedMlp::quantize(&g, &u, &dn, Activation::Relu, false, QuantFormat::Q8)?;
        let (s, t) = (sparse.forward(&x, true)?, dense.forward(&x, false)?);
        let fired: u64 = s.fired.as_ref().unwrap().iter().map(|&c| c as u64).sum();
        assert!(
            fired >= s.nonzeros && fired <= s.nonzeros + 2,
            "{fired} {}",
            s.nonzeros
        );
        // Up values that round to exactly zero aside, the counts agree.
        assert!(
            s.nonzeros >= t.nonzeros && s.nonzeros <= t.nonzeros + 2,
            "{} {}",
            s.nonzeros,
            t.nonzeros
        );
        assert!(s.nonzeros > 0 && s.nonzeros < (5 * f) as u64);
        let gx = x
            .matmul(&g.t()?)?
            .gt(0f32)?
            .to_dtype(candle_core::DType::F32)?
            .sum_all()?;
        let want = gx.to_scalar::<f32>()? as i64;
        assert!(
            (s.nonzeros as i64 - want).abs() <= 5,
            "{} vs {want}",
            s.nonzeros
        );
        Ok(())
    }

    #[test]
    fn bad_inputs_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        let g = Tensor::zeros((64, 32), candle_core::DType::F32, &dev)?;
        let dn = Tensor::zeros((32, 64), candle_core::DType::F32, &dev)?;
        let e = QuantizedMlp::quantize(&g, &g, &dn, Activation::Silu, true, QuantFormat::Q8)
            .unwrap_err();
        assert!(
            e.to_string().contains("ReLU") || e.to_string().contains("relu"),
            "{e}"
        );
        let q = QuantizedMlp::quantize(&g, &g, &dn, Activation::Relu, true, QuantFormat::Q8)?;
        let wrong = Tensor::zeros((2, 48), candle_core::DType::F32, &dev)?;
        assert!(q
            .forward(&wrong, false)
            .unwrap_err()
            .to_string()
            .contains("48"));
        let bf16 = Tensor::zeros((2, 32), candle_core::DType::BF16, &dev)?;
        assert!(q
            .forward(&bf16, false)
            .unwrap_err()
            .to_string()
            .contains("f32"));
        Ok(())
    }
}
