//! Whether the engine still runs. Every actor owns its inbox's receiving end on its own thread, so an
//! actor that panics (or returns) drops it and its inbox closes: the closed inbox is the signal, with no
//! state shared between the actors and the server. The scheduler stops when the runner is gone, so the
//! runner's death shows as the scheduler's inbox closing. Tokenizer workers hold no state and survive a
//! panic (only its request fails, `osprey-tokenizer`); their inbox closes only if every worker is gone.

use crate::Engine;

impl Engine {
    /// The first actor whose inbox is closed (it panicked or stopped), if any.
    pub fn stopped_actor(&self) -> Option<&'static str> {
        let optional = |s: Option<bool>| s.unwrap_or(false);
        if self.tokenizer.is_closed() {
            Some("tokenizer")
        } else if self.scheduler.is_closed() {
            Some("scheduler (or the runner it drives)")
        } else if optional(self.vision.as_ref().map(|v| v.is_closed())) {
            Some("vision encoder")
        } else if optional(self.prefix.as_ref().map(|p| p.is_closed())) {
            Some("prefix cache")
        } else if optional(self.experts.as_ref().map(|e| e.is_closed())) {
            Some("expert residency manager")
        } else {
            None
        }
    }

    /// Resolves when any actor's inbox closes, with the actor's name (see [`Engine::stopped_actor`]).
    pub async fn stopped(&self) -> &'static str {
        async fn closed<T>(s: Option<&tokio::sync::mpsc::UnboundedSender<T>>) {
            match s {
                Some(s) => s.closed().await,
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            _ = self.tokenizer.closed() => {}
            _ = self.scheduler.closed() => {}
            _ = closed(self.vision.as_ref()) => {}
            _ = closed(self.prefix.as_ref()) => {}
            _ = async { match &self.experts { Some(e) => e.closed().await, None => std::future::pending().await } } => {}
        }
        self.stopped_actor().unwrap_or("an actor")
    }
}
