candle_amp::policy! {
    pub struct Attention: fp16 {
        softmx: lower_precision,
    }
}

fn main() {}
