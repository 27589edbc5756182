candle_amp::policy! {
    pub struct Attention: fp16 {
        softmax: half,
    }
}

fn main() {}
