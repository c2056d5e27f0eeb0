//! How a [`SparseMlp`] call picks its side: the break-even rule or a fixed mode, or
//! `Auto`'s timings ([`crate::auto`]); and which calls measure the density.

use candle_core::{Module, Result, Tensor};

use super::{frozen, rows, Activation, FfnMode, L1Term, SparseMlp};
use crate::auto::{auto_runs_sparse, Cell, Entry, Side, Timer, AUTO_EVIDENCE_TOKENS};
use crate::error::{err, TwellError};

/// How a call is decided: by the break-even rule (or a fixed mode), or by `Auto`'s
/// timings of the candidates in a cell (with the rule's side for calls that may not be
/// timed while the cell is undecided).
enum AutoCell {
    Rule(Side),
    Timed(Cell, &'static [Side], Side),
}

impl SparseMlp {
    /// Whether this call takes the sparse path.
    pub(super) fn use_sparse(&self, tokens: usize, device: &candle_core::Device) -> bool {
        if self.bias.is_some() {
            return false;
        }
        match (self.activation, self.mode) {
            (Activation::Silu, _) | (_, FfnMode::Dense) => false,
            (_, FfnMode::Sparse) => true,
            (_, FfnMode::Auto) => auto_runs_sparse(
                tokens,
                device.is_cuda(),
                self.break_even,
                self.density_for(tokens),
            ),
        }
    }

    /// The side a call on `x` runs, and for a call of `Auto` that calibrates, its timer
    /// (started; finish it after the call). At inference `Auto` times its candidates and
    /// keeps the fastest ([`crate::auto`]); elsewhere it follows the break-even rule.
    pub(super) fn pick(
        &self,
        x: &Tensor,
        entry: Entry,
        want_l1: bool,
        measure: bool,
    ) -> Result<(Side, Option<Timer>)> {
        // Quantized CPU inference has one path per MLP: nothing to choose or time.
        if let Some(side) = self.quantized_side(x, want_l1) {
            *self.last_side.lock().expect("side lock") = Some(side);
            return Ok((side, None));
        }
        let (side, timing) = match self.auto_cell(x, entry, want_l1)? {
            AutoCell::Rule(side) => (side, None),
            // A measuring call on a GPU reads its counts back and runs unfolded: not the
            // cell's usual work, so it is not timed; until the cell has decided, it
            // follows the break-even rule (with statistics on, every call measures).
            AutoCell::Timed(cell, candidates, rule) if measure && x.device().is_cuda() => {
                (crate::auto::decided(cell, candidates).unwrap_or(rule), None)
            }
            AutoCell::Timed(cell, candidates, _) => crate::auto::choose(cell, candidates),
        };
        *self.last_side.lock().expect("side lock") = Some(side);
        let timer = timing.map(|t| t.start(x.device())).transpose()?;
        Ok((side, timer))
    }

    /// How `Auto` (or a fixed mode) decides a call on `x` through `entry`.
    fn auto_cell(&self, x: &Tensor, entry: Entry, want_l1: bool) -> Result<AutoCell> {
        let d = self.hidden();
        let got = x.dims().last().copied().unwrap_or(0);
        if got != d {
            return err(TwellError::ShapeMismatch {
                what: "SparseMlp::forward",
                detail: format!("input has {got} features, the MLP expects {d}"),
            });
        }
        let rows = x.elem_count() / d.max(1);
        let x2 = fused_ops::checks::reshaped(x, &[rows, d])?;
        let products = self.dense_side_runs_products(&x2, want_l1);
        let rule = match (self.use_sparse(rows, x.device()), products) {
            (true, _) => Side::Sparse,
            (false, true) => Side::Products,
            (false, false) => Side::Dense,
        };
        // `Auto` times its candidates at inference, unless the caller set a break-even.
        if !(self.auto_inference(x, want_l1) && self.break_even.is_none()) {
            return Ok(AutoCell::Rule(rule));
        }
        // Before a density is known the sparse path runs, and measures it.
        let Some(density) = self.density_for(rows) else {
            return Ok(AutoCell::Rule(Side::Sparse));
        };
        let cell = Cell::new(x.device(), (d, self.ffn()), entry, rows, density);
        let candidates: &'static [Side] = match products {
            true => &[Side::Sparse, Side::Products, Side::Dense],
            false => &[Side::Sparse, Side::Dense],
        };
        Ok(AutoCell::Timed(cell, candidates, rule))
    }

    /// Runs `x` through [`Module::forward`] until `Auto`'s timings have decided the calls
    /// like it (at most a few dozen calls), waiting for the device after each so that
    /// GPU timings land: for a benchmark that times `Auto` afterwards, or a server before
    /// its first request. Calls that `Auto` decides by rule, and other modes, return at
    /// once. Through the other entry points (`forward_add_norm`, the sublayers) `Auto`
    /// calibrates on the calls it serves.
    pub fn calibrate(&self, x: &Tensor) -> Result<()> {
        const MAX_CALLS: usize = 64;
        for _ in 0..MAX_CALLS {
            match self.auto_cell(x, Entry::Mlp, false)? {
                AutoCell::Rule(_) if self.density_for(rows(x)).is_some() => return Ok(()),
                // With statistics on, every GPU call measures, and none is timed.
                AutoCell::Timed(..) if self.record_stats && x.device().is_cuda() => return Ok(()),
                AutoCell::Timed(cell, candidates, _)
                    if crate::auto::decided(cell, candidates).is_some() =>
                {
                    return Ok(())
                }
                _ => {}
            }
            Module::forward(self, x)?;
            x.device().synchronize()?;
        }
        Ok(())
    }

    /// The side the last call ran: for a benchmark or a log that asks what `Auto` chose.
    /// `None` before the first call.
    pub fn last_side(&self) -> Option<Side> {
        *self.last_side.lock().expect("side lock")
    }

    /// Whether a call on `x` is `Auto` at inference (no autograd, frozen weights) on a
    /// ReLU MLP without biases, with the plain L1 term if one is asked for: the calls
    /// that may take the products path, and that `Auto` times.
    fn auto_inference(&self, x: &Tensor, want_l1: bool) -> bool {
        self.mode == FfnMode::Auto
            && self.bias.is_none()
            && self.activation == Activation::Relu
            && (!want_l1 || self.l1_term == L1Term::Plain)
            && !x.track_op()
            && [&self.gate, &self.up, &self.down].into_iter().all(frozen)
    }

    /// Runs `work` on the side [`Self::pick`] chose, and finishes the call's timing.
    pub(super) fn timed<R>(
        &self,
        device: &candle_core::Device,
        timer: Option<Timer>,
        work: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let out = work()?;
        if let Some(timer) = timer {
            timer.finish(device)?;
        }
        Ok(out)
    }

    /// The last measured density, if it was measured on enough rows to decide a call of
    /// `tokens` rows ([`AUTO_EVIDENCE_TOKENS`]).
    pub(super) fn density_for(&self, tokens: usize) -> Option<f64> {
        self.last_density
            .lock()
            .expect("density lock")
            .filter(|&(_, rows)| rows >= tokens.min(AUTO_EVIDENCE_TOKENS))
            .map(|(density, _)| density)
    }

    /// The last measured density, whatever it was measured on.
    pub(super) fn last_density(&self) -> Option<f64> {
        self.last_density
            .lock()
            .expect("density lock")
            .map(|(density, _)| density)
    }

    /// Files a density measured on `tokens` rows.
    pub(super) fn set_density(&self, density: f64, tokens: usize) {
        *self.last_density.lock().expect("density lock") = Some((density, tokens));
    }

    /// Whether a call that `Auto` sends to the dense side runs
    /// [`crate::twell_mlp_products`] (cuBLAS GEMMs around one element-wise kernel
    /// that also counts the active neurons) instead of candle's three matmuls: on a GPU,
    /// for inference (the op has no backward), with ReLU and the plain L1 term. `Dense`
    /// stays candle's own MLP, the reference the benchmarks compare against.
    fn dense_side_runs_products(&self, x2: &Tensor, want_l1: bool) -> bool {
        self.auto_inference(x2, want_l1) && crate::products_run(x2, self.ffn())
    }

    /// Whether this call should measure the density: every `recheck_calls` calls in
    /// Auto mode (on a GPU a read-back is a sync, on the host a dense pass counts its
    /// activations once more), when none is known, and on a GPU when training (the
    /// backward picks its weight-gradient path from it). [`Self::measures_free`] adds
    /// the calls where measuring costs nothing.
    pub(super) fn measure_now(&self, device: &candle_core::Device, tokens: usize) -> bool {
        let call = self
            .calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let training = !frozen(&self.gate) || !frozen(&self.up) || !frozen(&self.down);
        let recheck = self.recheck_calls > 0 && call.is_multiple_of(self.recheck_calls);
        let unmeasured = self.density_for(tokens).is_none();
        self.record_stats
            || (self.mode == FfnMode::Auto && (recheck || unmeasured))
            || (training && device.is_cuda() && recheck)
    }

    /// Whether a call on `side` measures the density for free: a host call of `Auto` on
    /// the TwELL path, whose pattern is on the host anyway.
    pub(super) fn measures_free(&self, device: &candle_core::Device, side: Side) -> bool {
        self.mode == FfnMode::Auto && device.is_cpu() && side == Side::Sparse
    }
}
