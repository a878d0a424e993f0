//! The geometry every convolution kernel runs on.

/// One convolution as the kernels see it: `groups` independent convolutions
/// of `icg` input channels into `ocg` output channels. Output (oy, ox) reads
/// input row `oy·sh + ky·dh − pt` and column `ox·sw + kx·dw − pl`; what lies
/// outside the input is zero. `oh`/`ow` may be smaller than the window count
/// (a transposed convolution's input with output_padding ≥ stride), and the
/// padding may be negative (the backward of a convolution padded by more
/// than its kernel's reach crops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geom {
    pub n: usize,
    pub groups: usize,
    pub icg: usize,
    pub ocg: usize,
    pub h: usize,
    pub w: usize,
    pub oh: usize,
    pub ow: usize,
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub dh: usize,
    pub dw: usize,
    pub pt: isize,
    pub pl: isize,
}

impl Geom {
    pub fn c_in(&self) -> usize {
        self.groups * self.icg
    }
    pub fn c_out(&self) -> usize {
        self.groups * self.ocg
    }
    pub fn in_plane(&self) -> usize {
        self.h * self.w
    }
    pub fn out_plane(&self) -> usize {
        self.oh * self.ow
    }
    pub fn taps(&self) -> usize {
        self.kh * self.kw
    }
    /// Rows of the unfolded input: input channels × kernel taps of a group.
    pub fn k_len(&self) -> usize {
        self.icg * self.taps()
    }
    pub fn input_len(&self) -> usize {
        self.n * self.c_in() * self.in_plane()
    }
    pub fn output_len(&self) -> usize {
        self.n * self.c_out() * self.out_plane()
    }
    pub fn weight_len(&self) -> usize {
        self.c_out() * self.k_len()
    }
    /// The geometry whose forward is this one's input gradient when the
    /// stride is 1: a convolution of the output gradient with the flipped,
    /// transposed weight, padded by the kernel's reach minus the padding.
    pub fn flipped(&self) -> Geom {
        Geom {
            n: self.n,
            groups: self.groups,
            icg: self.ocg,
            ocg: self.icg,
            h: self.oh,
            w: self.ow,
            oh: self.h,
            ow: self.w,
            kh: self.kh,
            kw: self.kw,
            sh: 1,
            sw: 1,
            dh: self.dh,
            dw: self.dw,
            pt: ((self.kh - 1) * self.dh) as isize - self.pt,
            pl: ((self.kw - 1) * self.dw) as isize - self.pl,
        }
    }
}
