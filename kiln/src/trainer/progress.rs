//! The progress bar of a fit ([`Progress`]).

/// Whether to show a progress bar.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Progress {
    /// When stderr is a terminal and kiln was built with its `progress`
    /// feature (the default).
    #[default]
    Auto,
    /// Never.
    Off,
}

/// A progress bar when the `progress` feature is on and one is wanted.
pub(super) struct Bar {
    #[cfg(feature = "progress")]
    bar: Option<indicatif::ProgressBar>,
}

impl Bar {
    pub(super) fn new(progress: Progress, steps: u64) -> Bar {
        #[cfg(feature = "progress")]
        {
            use std::io::IsTerminal;
            let bar = (progress == Progress::Auto && std::io::stderr().is_terminal()).then(|| {
                let b = indicatif::ProgressBar::new(steps);
                if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed_precise} {msg}") {
                    b.set_style(style);
                }
                b
            });
            Bar { bar }
        }
        #[cfg(not(feature = "progress"))]
        {
            let _ = (progress, steps);
            Bar {}
        }
    }
    pub(super) fn shown(&self) -> bool {
        #[cfg(feature = "progress")]
        return self.bar.is_some();
        #[cfg(not(feature = "progress"))]
        false
    }
    pub(super) fn inc(&self) {
        #[cfg(feature = "progress")]
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }
    pub(super) fn message(&self, msg: String) {
        #[cfg(feature = "progress")]
        if let Some(b) = &self.bar {
            b.set_message(msg);
        }
        #[cfg(not(feature = "progress"))]
        let _ = msg;
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        #[cfg(feature = "progress")]
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
