candle_amp::policy! {
    pub struct Attention: bf16 {
        softmax: lower_precision,
        softmax: fp32,
    }
}

fn main() {}
