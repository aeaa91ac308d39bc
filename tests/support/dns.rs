//! A DNS server on loopback UDP that answers every A question with the addresses a test sets (TTL 0), and no
//! address for anything else: the nameserver of discovered endpoints, changed as a rollout would change them.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hickory_resolver::proto::op::Message;
use hickory_resolver::proto::rr::rdata::A;
use hickory_resolver::proto::rr::{RData, Record, RecordType};
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

pub struct DnsServer {
    addr: SocketAddr,
    answers: Arc<Mutex<Vec<Ipv4Addr>>>,
    questions: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl DnsServer {
    pub async fn start(addresses: &[Ipv4Addr]) -> DnsServer {
        let socket = UdpSocket::bind("127.0.0.1:0").await.expect("binding the DNS server");
        let addr = socket.local_addr().expect("the DNS server's address");
        let answers = Arc::new(Mutex::new(addresses.to_vec()));
        let questions = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let (answers, questions) = (answers.clone(), questions.clone());
            async move {
                let mut buffer = vec![0u8; 1500];
                loop {
                    let Ok((len, from)) = socket.recv_from(&mut buffer).await else {
                        return;
                    };
                    let Ok(query) = Message::from_vec(&buffer[..len]) else {
                        continue;
                    };
                    let mut answer = Message::response(query.metadata.id, query.metadata.op_code);
                    answer.metadata.recursion_desired = query.metadata.recursion_desired;
                    answer.metadata.recursion_available = true;
                    answer.metadata.authoritative = true;
                    for question in &query.queries {
                        answer.add_query(question.clone());
                        if question.query_type() == RecordType::A {
                            questions.fetch_add(1, Ordering::SeqCst);
                            for ip in answers.lock().unwrap().iter() {
                                answer.add_answer(Record::from_rdata(question.name().clone(), 0, RData::A(A(*ip))));
                            }
                        }
                    }
                    if let Ok(bytes) = answer.to_vec() {
                        let _ = socket.send_to(&bytes, from).await;
                    }
                }
            }
        });
        DnsServer {
            addr,
            answers,
            questions,
            task,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The addresses every A question is answered with from now (none: an answer without records).
    pub fn set(&self, addresses: &[Ipv4Addr]) {
        *self.answers.lock().unwrap() = addresses.to_vec();
    }

    /// A questions answered so far.
    pub fn questions(&self) -> usize {
        self.questions.load(Ordering::SeqCst)
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
